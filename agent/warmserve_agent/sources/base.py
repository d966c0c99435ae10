"""What a model source is: one protocol every scheme implements, and the facts they exchange.

A source knows how to list a model's files (with sizes and, where the remote publishes them,
checksums), stream one file from an offset (so an interrupted download resumes), and read a byte
range (to learn a model's size and layers from its ``config.json`` and safetensors headers
without downloading it).  *In-place* sources (``pvc://``, ``file://``) are directories the agent
can read directly: the store links them instead of copying.  Everything else — coalescing,
budget, retries, checksum checks, progress — is the fetcher's job
(:mod:`warmserve_agent.sources.fetcher`), the same for every scheme.

A listing is the remote's word, so every listed path is checked (:func:`check_remote_path`)
before anything is filtered or written: a relative path of ``/``-separated parts, none empty,
``.``, ``..`` or holding a backslash or NUL.  Sources never see a local path: they write into a
file object the fetcher opened inside its staging directory
(:mod:`~warmserve_agent.sources.fetch_staging`).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

from warmserve_agent.store import config_num_layers


class SourceError(Exception):
    """A source that cannot be read (unreachable, missing, forbidden, malformed).

    ``retryable`` marks transient failures (network, 5xx) worth another attempt; a missing repo
    or a bad URI is not.
    """

    def __init__(self, message: str, *, retryable: bool = False, checksum: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.checksum = checksum  # the client library itself found the bytes corrupt


@dataclass(frozen=True, slots=True)
class RemoteFile:
    """One file of a model at its source. Checksums are hex; empty when the source has none."""

    path: str  # relative, '/'-separated
    size: int
    sha256: str = ""  # Hugging Face LFS files, S3 x-amz-checksum-sha256 (full object)
    git_sha1: str = ""  # Hugging Face non-LFS files: the git blob id
    md5: str = ""  # S3 single-part ETag
    # The remote's version of the file (S3 ETag; hf:// files are pinned by the listing's
    # commit): a partial download is resumed only from the same version.
    etag: str = ""

    def checks(self) -> str:
        """Which checks a downloaded copy gets, for logs and errors."""
        kinds = [
            k
            for k, v in (("sha256", self.sha256), ("git-sha1", self.git_sha1), ("md5", self.md5))
            if v
        ]
        return "size+" + "+".join(kinds) if kinds else "size"


@dataclass(frozen=True, slots=True)
class Listing:
    """The files to fetch for a model (already filtered) and the revision they belong to."""

    files: tuple[RemoteFile, ...]
    revision: str = ""  # commit for hf://; "" when the source has no versions

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the planner needs about a model no node holds yet (from config + headers only)."""

    num_layers: int
    weight_bytes: int
    num_tensors: int
    max_batch: int = 0  # from config.json's "warmserve" profile, if any


class ModelSource(Protocol):
    """One scheme's access to one model (see the module docstring)."""

    uri: str
    in_place: bool  # True: read where it is (link, no copy, no budget)

    def list_files(self) -> Listing: ...

    def download(self, f: RemoteFile, out: BinaryIO, start: int, listing: Listing) -> None:
        """Write bytes ``start`` to the end of ``f`` to ``out`` (an HTTP/S3 ranged read when
        ``start`` > 0); raise SourceError (``retryable`` for a dropped connection: the bytes
        already written are kept and the next attempt resumes after them)."""

    def read_range(self, path: str, start: int, length: int, listing: Listing) -> bytes: ...

    def location(self) -> Path:
        """In-place sources: the directory to link. Others raise NotImplementedError."""


@dataclass(frozen=True, slots=True)
class SourceSettings:
    """Agent-wide settings sources need (from flags; tokens and credentials never go on a wire)."""

    hf_endpoint: str = ""  # "" = huggingface_hub's default (HF_ENDPOINT or the public hub)
    hf_token: str = ""
    s3_endpoint_url: str = ""
    s3_region: str = ""
    pvc_root: Path = Path("/mnt/warmserve/pvc")  # pvc://CLAIM is mounted at <pvc_root>/<CLAIM>
    allowed_paths: tuple[Path, ...] = ()  # file:// must lie under one of these
    timeout_s: float = 60.0


SourceFactory = Callable[[object, SourceSettings, str], ModelSource]

# Files a model needs: weights (safetensors only: never pickles), configs, tokenizers, templates.
WANTED = (
    "*.safetensors",
    "*.json",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jinja",
)
SKIPPED_DIRS = ("original/", ".")  # consolidated checkpoints of other formats; hidden files


REMOTE_PATH_MAX = 1024


def check_remote_path(path: str, what: str) -> str:
    """``path`` if it is a safe relative path for a listed file, else SourceError naming it
    (``what``: the source and, for S3, the key).  Refused, never normalised: a listing holding
    such a path is not trusted at all."""
    why = ""
    if not isinstance(path, str) or not path:
        why = "empty"
    elif len(path) > REMOTE_PATH_MAX:
        why = f"longer than {REMOTE_PATH_MAX} characters"
    elif "\0" in path:
        why = "contains NUL"
    elif "\\" in path:
        why = "contains a backslash"
    elif path.startswith("/"):
        why = "absolute (a '//' in an S3 key makes one)"
    elif any(ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        why = "contains a control character"
    else:
        parts = path.split("/")
        if "" in parts:
            why = "has an empty segment ('//' or a trailing '/')"
        elif "." in parts or ".." in parts:
            why = "has a '.' or '..' segment"
    if why:
        raise SourceError(f"{what}: listed file {path[:200]!r} is refused: its path is {why}")
    return path


def wanted(path: str) -> bool:
    """Whether a model file is fetched (WANTED names, not under SKIPPED_DIRS)."""
    if any(path.startswith(d) or f"/{d}" in f"/{path}" for d in SKIPPED_DIRS):
        return False
    name = path.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(name, p) for p in WANTED)


def select(files: Iterable[RemoteFile], uri: str) -> tuple[RemoteFile, ...]:
    """The files to fetch, or SourceError when the source does not look like a model or lists
    a path that is not safe (:func:`check_remote_path`: every listed path, fetched or not)."""
    files = list(files)
    for f in files:
        check_remote_path(f.path, uri)
        if f.size < 0:
            raise SourceError(f"{uri}: listed file {f.path!r} has a negative size")
    chosen = tuple(sorted((f for f in files if wanted(f.path)), key=lambda f: f.path))
    names = {f.path for f in chosen}
    if "config.json" not in names:
        raise SourceError(f"{uri} has no config.json at its top level: not a model directory")
    if not any(p.endswith(".safetensors") for p in names):
        raise SourceError(
            f"{uri} has no *.safetensors weights (only safetensors are loaded; convert other "
            "formats first)"
        )
    return chosen


def exact_range(data: bytes, what: str, start: int, length: int) -> bytes:
    """``data`` if it is the ``length`` bytes asked for, else a retryable SourceError."""
    if len(data) != length:
        raise SourceError(
            f"{what}: asked for {length} bytes at {start}, got {len(data)}", retryable=True
        )
    return data


# ---- checksums --------------------------------------------------------------------------------
def file_digests(path: Path, want: RemoteFile) -> dict[str, str]:
    """The digests ``want`` publishes, computed over ``path`` in one pass."""
    h256 = hashlib.sha256() if want.sha256 else None
    hmd5 = hashlib.md5(usedforsecurity=False) if want.md5 else None
    hgit = None
    if want.git_sha1:
        hgit = hashlib.sha1(usedforsecurity=False)
        hgit.update(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(4 * 1024 * 1024):
            for h in (h256, hmd5, hgit):
                if h is not None:
                    h.update(chunk)
    out = {}
    if h256 is not None:
        out["sha256"] = h256.hexdigest()
    if hmd5 is not None:
        out["md5"] = hmd5.hexdigest()
    if hgit is not None:
        out["git_sha1"] = hgit.hexdigest()
    return out


@dataclass(frozen=True, slots=True)
class FileProblem:
    """How a downloaded file differs from its listing: its size, or a published checksum."""

    text: str
    size: bool  # the size differs (else a checksum)

    def __str__(self) -> str:
        return self.text


def verify_file(path: Path, want: RemoteFile) -> FileProblem | None:
    """None if ``path`` is ``want`` (size and every published checksum), else what differs."""
    size = path.stat().st_size if path.exists() else -1
    if size != want.size:
        return FileProblem(f"{want.path}: size {size} bytes, expected {want.size}", size=True)
    got = file_digests(path, want)
    for kind, value in got.items():
        expected = getattr(want, kind)
        if value != expected.lower():
            return FileProblem(f"{want.path}: {kind} {value}, expected {expected}", size=False)
    return None


# ---- inspection -------------------------------------------------------------------------------
def _header_from(read: Callable[[int, int], bytes], path: str, size: int) -> dict:
    head = read(0, 8)
    if len(head) != 8:
        raise SourceError(f"{path}: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", head)
    if n > 100 * 1024 * 1024 or 8 + n > size:
        raise SourceError(f"{path}: safetensors header of {n} bytes is implausible")
    try:
        header = json.loads(read(8, n))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SourceError(f"{path}: bad safetensors header: {exc}") from None
    header.pop("__metadata__", None)
    return header


def inspect(source: ModelSource) -> ModelFacts:
    """Layers and weight bytes of the model at ``source`` from config.json and safetensors
    headers (a few kilobytes per file), without downloading the weights."""
    listing = source.list_files()
    files = {f.path: f for f in listing.files}
    cfg_file = files["config.json"]
    raw = source.read_range("config.json", 0, cfg_file.size, listing)
    try:
        cfg = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SourceError(f"{source.uri}: config.json is not JSON: {exc}") from None
    layers = config_num_layers(cfg)
    if layers is None:
        raise SourceError(f"{source.uri}: config.json needs num_hidden_layers >= 1")
    weight = 0
    tensors = 0
    for f in listing.files:
        if not f.path.endswith(".safetensors"):
            continue
        header = _header_from(
            lambda s, n, f=f: source.read_range(f.path, s, n, listing), f.path, f.size
        )
        for meta in header.values():
            b, e = meta["data_offsets"]
            weight += e - b
            tensors += 1
    profile = cfg.get("warmserve") if isinstance(cfg.get("warmserve"), dict) else {}
    max_batch = profile.get("max_batch", 0) if isinstance(profile.get("max_batch"), int) else 0
    return ModelFacts(layers, weight, tensors, max_batch)


@dataclass
class Registry:
    """Sources by URI scheme (``hf``, ``s3``, ``pvc``, ``file``); plug-ins add theirs."""

    factories: dict[str, SourceFactory] = field(default_factory=dict)

    def register(self, scheme: str, factory: SourceFactory) -> None:
        if scheme in self.factories:
            raise ValueError(f"a model source for {scheme}:// is already registered")
        self.factories[scheme] = factory
