"""``hf://ORG/NAME[@REVISION]``: a model repo on the Hugging Face Hub, through ``huggingface_hub``.

* The revision is a branch, tag or commit (:func:`warmserve.modelref.check_revision`: never a
  pull-request ref).  It is resolved to a commit once (``model_info(..., files_metadata=True)``;
  the answer must be a 40-hex commit id); every file is then downloaded at that commit, so a push
  during a download cannot mix revisions.
* Downloads go through ``huggingface_hub``'s own streaming GET (``file_download.http_get``: LFS
  redirects, a ``Range`` from the bytes already there, resuming itself after a dropped
  connection) into the file the fetcher opened; a download cut off for longer is resumed by the
  fetcher's next attempt or next fetch from what reached the disk.
* Checksums come from the same listing: LFS files carry their sha256, other files their git blob
  id; the fetcher checks both after each download (``huggingface_hub`` itself checks sizes only).
* The endpoint is ``--hf-endpoint`` or ``HF_ENDPOINT`` (a mirror, or the tests' local server);
  the token is ``--hf-token-file`` (the chart mounts a Secret there), never an argument on a wire.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, BinaryIO

from warmserve.modelref import HfRef, SourceURIError, check_revision
from warmserve_agent.sources.base import (
    Listing,
    RemoteFile,
    SourceError,
    SourceSettings,
    exact_range,
    select,
)
from warmserve_agent.sources.fetch_records import FetchFailed

_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def _hub() -> Any:
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
        import huggingface_hub.file_download
        import huggingface_hub.utils
    except ImportError as exc:  # pragma: no cover - a core dependency
        raise SourceError("hf:// sources need the huggingface_hub package") from exc
    huggingface_hub.utils.disable_progress_bars()  # progress goes to status/metrics, not stderr
    # The client writes a download in chunks of this size (10 MiB by default); the fetcher's
    # progress is what reached the disk, so a smaller chunk means finer progress and ETA.
    huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE = 1024 * 1024
    return huggingface_hub


def _translate(exc: Exception, what: str) -> SourceError:
    hub = _hub()
    errors = hub.errors
    if isinstance(exc, errors.GatedRepoError):
        return SourceError(f"{what}: gated repository; accept its terms with the token's account")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return SourceError(
            f"{what}: repository not found, or private and the agent's token cannot read it "
            "(set agent.modelSources.huggingface.secretName)"
        )
    if isinstance(exc, errors.RevisionNotFoundError):
        return SourceError(f"{what}: revision not found")
    if isinstance(exc, errors.EntryNotFoundError):
        return SourceError(f"{what}: file not found at this revision")
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status in (401, 403):
        return SourceError(
            f"{what}: access denied ({status}); check the agent's Hugging Face token"
        )
    # Network errors, 5xx, 429, short reads: worth another attempt.
    return SourceError(f"{what}: {type(exc).__name__}: {exc}", retryable=True)


class HfSource:
    in_place = False

    def __init__(self, ref: HfRef, settings: SourceSettings, uri: str) -> None:
        try:
            check_revision(ref.revision)  # the URI was parsed, but a ref may be built elsewhere
        except SourceURIError as exc:
            raise SourceError(f"{uri}: {exc}") from None
        self.ref = ref
        self.uri = uri
        self.endpoint = settings.hf_endpoint or None
        self.token: str | bool = settings.hf_token or False  # never the ~/.cache token
        self.timeout = settings.timeout_s

    def _api(self) -> Any:
        return _hub().HfApi(endpoint=self.endpoint, token=self.token)

    def list_files(self) -> Listing:
        try:
            info = self._api().model_info(
                self.ref.repo_id,
                revision=self.ref.revision,
                files_metadata=True,
                timeout=self.timeout,
            )
        except Exception as exc:
            raise _translate(exc, self.uri) from None
        if not info.sha or not _COMMIT_RE.match(info.sha):
            raise SourceError(
                f"{self.uri}: the hub did not say which commit {self.ref.revision} is "
                f"(answered {str(info.sha)[:80]!r})"
            )
        files = []
        for s in info.siblings or []:
            if s.size is None:
                raise SourceError(f"{self.uri}: the hub listed {s.rfilename} without a size")
            files.append(
                RemoteFile(
                    s.rfilename,
                    int(s.size),
                    sha256=(s.lfs.sha256 if s.lfs else ""),
                    git_sha1=("" if s.lfs else (s.blob_id or "")),
                )
            )
        return Listing(select(files, self.uri), revision=info.sha)

    def download(self, f: RemoteFile, out: BinaryIO, start: int, listing: Listing) -> None:
        hub = _hub()
        url = hub.hf_hub_url(
            self.ref.repo_id, f.path, revision=listing.revision, endpoint=self.endpoint
        )
        headers = hub.utils.build_hf_headers(token=self.token)
        try:
            hub.file_download.http_get(
                url,
                out,
                resume_size=start,
                headers=headers,
                expected_size=f.size,
                displayed_filename=f.path,
            )
        except (SourceError, FetchFailed):  # ours, from writing (size cap, disk reserve)
            raise
        except ValueError as exc:  # the client refuses the file (e.g. too large without Xet)
            raise SourceError(f"{self.uri} {f.path}: {exc}") from None
        except Exception as exc:
            raise _translate(exc, f"{self.uri} {f.path}") from None

    def read_range(self, path: str, start: int, length: int, listing: Listing) -> bytes:
        hub = _hub()
        url = hub.hf_hub_url(
            self.ref.repo_id, path, revision=listing.revision, endpoint=self.endpoint
        )
        headers = hub.utils.build_hf_headers(token=self.token)
        headers["range"] = f"bytes={start}-{start + length - 1}"
        try:
            r = hub.utils.get_session().get(
                url, headers=headers, timeout=self.timeout, follow_redirects=True
            )
            hub.utils.hf_raise_for_status(r)
        except Exception as exc:
            raise _translate(exc, f"{self.uri} {path}") from None
        data = r.content
        if r.status_code == 200:  # the server ignored the range
            data = data[start : start + length]
        return exact_range(data, f"{self.uri} {path}", start, length)

    def location(self) -> Path:
        raise NotImplementedError("hf:// sources are downloaded, not linked")
