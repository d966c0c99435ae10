"""``hf://ORG/NAME[@REVISION]``: a model repo on the Hugging Face Hub, through ``huggingface_hub``.

* The branch or tag is resolved to a commit once (``model_info(..., files_metadata=True)``); every
  file is then downloaded at that commit, so a push during a download cannot mix revisions.
* Checksums come from the same listing: LFS files carry their sha256, other files their git blob
  id; the fetcher checks both after each download (``huggingface_hub`` itself checks sizes only).
* The endpoint is ``--hf-endpoint`` or ``HF_ENDPOINT`` (a mirror, or the tests' local server);
  the token is ``--hf-token-file`` (the chart mounts a Secret there), never an argument on a wire.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from warmserve.modelref import HfRef
from warmserve_agent.sources.base import (
    Listing,
    RemoteFile,
    SourceError,
    SourceSettings,
    exact_range,
    select,
)


def _hub() -> Any:
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
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
        if not info.sha:
            raise SourceError(
                f"{self.uri}: the hub did not say which commit {self.ref.revision} is"
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

    def download(self, f: RemoteFile, dest: Path, listing: Listing) -> None:
        # hf_hub_download into a private folder (it keeps its own metadata in .cache/ there),
        # then move the file into place: the fetcher owns the final layout.
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".hf-") as tmp:
            try:
                got = _hub().hf_hub_download(
                    self.ref.repo_id,
                    f.path,
                    revision=listing.revision,
                    local_dir=tmp,
                    endpoint=self.endpoint,
                    token=self.token,
                    force_download=True,
                )
            except Exception as exc:
                raise _translate(exc, f"{self.uri} {f.path}") from None
            shutil.move(got, dest)

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
