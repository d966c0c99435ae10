"""Model names and model source URIs: the one definition the CRD, the operator and the agent share.

**Names** (``spec.model.name``; the key of a model everywhere: policy, agent store, metrics):
1-200 characters, one or two ``/``-separated parts of ``[A-Za-z0-9._-]`` each starting with a
letter or digit (``llama-3-8b``, ``meta-llama/Llama-3.1-8B-Instruct``).  The CRD's OpenAPI
pattern and maxLength are the same rule (a test compares them).

**Store directories** (:func:`store_dirname`, the only place a model's place in a node's weight
store is computed): every model is *one* entry directly under the store's root, its name with
``/`` written as ``~`` (``<store>/meta-llama~Llama-3.1-8B-Instruct``).  ``~`` is outside the
name alphabet, so the mapping is one-to-one and reversible (:func:`model_of_store_entry`), and no
model's directory can be the parent of another's: deleting ``meta-llama`` cannot touch
``meta-llama/Llama-3.1-8B``.  Entries start with a letter or digit, so they never meet the
store's own hidden files (``.warmserve-*``).

**Sources** (``spec.model.source``, optional; where an agent fetches a model its store lacks):

==============================  ==========================================================
``hf://ORG/NAME[@REVISION]``    a Hugging Face Hub model repo (branch, tag or commit;
                                default ``main``; :func:`check_revision`), via
                                ``huggingface_hub``
``s3://BUCKET/PREFIX``          the objects under PREFIX in an S3(-compatible) bucket
``pvc://CLAIM[/PATH]``          a PersistentVolumeClaim mounted into the agent pods
``file:///ABSOLUTE/PATH``       a directory on the node (under an allowed root)
==============================  ==========================================================

Paths never contain ``..`` segments, empty segments or a trailing ``/``.  The CRD validates the
same grammar with CEL (``x-kubernetes-validations`` on ``spec.model.source``); a test applies a
table of URIs to a real API server and checks it agrees with :func:`parse_source` case by case.

Pure: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "MODEL_NAME_MAX",
    "MODEL_NAME_PATTERN",
    "SOURCE_MAX",
    "FileRef",
    "HfRef",
    "PvcRef",
    "S3Ref",
    "SourceRef",
    "SourceURIError",
    "check_model_name",
    "check_revision",
    "model_of_store_entry",
    "parse_source",
    "store_dirname",
]

MODEL_NAME_MAX = 200
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
# Exactly the CRD's pattern for spec.model.name.
MODEL_NAME_PATTERN = rf"^{_PART}(/{_PART})?$"
_NAME_RE = re.compile(MODEL_NAME_PATTERN)

# One directory entry per model: '/' becomes a character the name alphabet lacks.
STORE_SEP = "~"

SOURCE_MAX = 1024
_HF_RE = re.compile(rf"^hf://({_PART}/{_PART})(?:@(.*))?$")
# A branch, tag or commit: git ref segments of [A-Za-z0-9._-], each starting with a letter or
# digit (so never '.', '..', '-x' or empty); the CRD's CEL rule for hf:// is the same grammar.
REVISION_MAX = 255
_REV_SEG = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REV_RE = re.compile(rf"^{_REV_SEG}(/{_REV_SEG})*$")
_REV_REFS_RE = re.compile(rf"^refs/(heads|tags)/{_REV_SEG}(/{_REV_SEG})*$")
_S3_RE = re.compile(r"^s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/([A-Za-z0-9!_.*()/-]+)$")
# A PersistentVolumeClaim name (DNS-1123 subdomain, at most 253 characters).
_CLAIM = r"[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?"
_PVC_RE = re.compile(rf"^pvc://(?P<claim>{_CLAIM})(?P<path>(?:/[A-Za-z0-9._-]+)*)$")
_FILE_RE = re.compile(r"^file://(?P<path>(?:/[A-Za-z0-9._-]+)+)$")
_DOTDOT_RE = re.compile(r"(^|/)\.\.?(/|$)")


class SourceURIError(ValueError):
    """A model name or source URI that breaks the grammar; the message says the right form."""


def check_model_name(name: str) -> str:
    """``name`` if it is a valid model name, else :class:`SourceURIError`."""
    if not isinstance(name, str) or not name:
        raise SourceURIError("model name is empty")
    if len(name) > MODEL_NAME_MAX:
        raise SourceURIError(
            f"model name {name[:40]!r}... is {len(name)} characters; at most {MODEL_NAME_MAX}"
        )
    if not _NAME_RE.fullmatch(name):
        raise SourceURIError(
            f"malformed model name {name[:MODEL_NAME_MAX]!r}: use NAME or ORG/NAME, each part of "
            "[A-Za-z0-9._-] starting with a letter or digit (e.g. meta-llama/Llama-3.1-8B)"
        )
    return name


def store_dirname(name: str) -> str:
    """The one directory entry under a weight store's root that holds model ``name`` (module
    docstring); :class:`SourceURIError` for a malformed name."""
    return check_model_name(name).replace("/", STORE_SEP)


def model_of_store_entry(entry: str) -> str | None:
    """The model a store entry holds (the inverse of :func:`store_dirname`), or None when the
    entry is no model's (hidden files, ``lost+found``, anything else)."""
    if "/" in entry or entry.count(STORE_SEP) > 1:
        return None
    name = entry.replace(STORE_SEP, "/")
    try:
        check_model_name(name)
    except SourceURIError:
        return None
    return name


def check_revision(rev: str) -> str:
    """``rev`` if it names a branch, tag or commit, else :class:`SourceURIError`.

    Refused: pull-request and other special refs (``refs/pr/N``, ``refs/convert/...``: code
    nobody merged, which anyone may push), and what git itself refuses in a ref name (``..``, a
    segment ending in ``.`` or ``.lock``, empty segments, other characters).  ``refs/heads/X``
    and ``refs/tags/X`` are a branch and a tag spelled out."""
    form = (
        "REVISION is a branch, tag or commit: '/'-separated parts of [A-Za-z0-9._-], each "
        "starting with a letter or digit, e.g. main, v1.0, release/2024-06 or a commit id"
    )
    if not isinstance(rev, str) or not rev:
        raise SourceURIError(f"empty hf:// revision; {form}")
    if len(rev) > REVISION_MAX:
        raise SourceURIError(f"hf:// revision of {len(rev)} characters; at most {REVISION_MAX}")
    parts = rev.split("/")
    if not _REV_RE.fullmatch(rev) or ".." in rev or any(p.endswith((".", ".lock")) for p in parts):
        raise SourceURIError(f"bad hf:// revision {rev[:80]!r}: {form}")
    if parts[0] == "refs" and not _REV_REFS_RE.fullmatch(rev):
        raise SourceURIError(
            f"hf:// revision {rev[:80]!r} is not a branch, tag or commit: only refs/heads/... "
            "and refs/tags/... refs are allowed (pull-request refs such as refs/pr/1 hold "
            "unmerged code)"
        )
    return rev


@dataclass(frozen=True, slots=True)
class HfRef:
    repo_id: str
    revision: str = "main"
    scheme: str = "hf"


@dataclass(frozen=True, slots=True)
class S3Ref:
    bucket: str
    prefix: str
    scheme: str = "s3"


@dataclass(frozen=True, slots=True)
class PvcRef:
    claim: str
    path: str = ""  # relative to the volume root; "" = the root
    scheme: str = "pvc"


@dataclass(frozen=True, slots=True)
class FileRef:
    path: str  # absolute
    scheme: str = "file"


SourceRef = HfRef | S3Ref | PvcRef | FileRef

_FORMS = "hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX, pvc://CLAIM[/PATH] or file:///PATH"


def parse_source(uri: str) -> SourceRef:
    """Parse a source URI (module docstring) or raise :class:`SourceURIError`."""
    if not isinstance(uri, str) or not uri:
        raise SourceURIError(f"model source is empty; use {_FORMS}")
    if len(uri) > SOURCE_MAX:
        raise SourceURIError(f"model source is {len(uri)} characters; at most {SOURCE_MAX}")
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in ("hf", "s3", "pvc", "file"):
        raise SourceURIError(f"unsupported model source {uri[:80]!r}: use {_FORMS}")
    if _DOTDOT_RE.search(rest):
        raise SourceURIError(
            f"model source {uri[:80]!r}: '.' and '..' path segments are not allowed"
        )
    if scheme == "hf":
        m = _HF_RE.fullmatch(uri)
        if not m:
            raise SourceURIError(
                f"bad hf:// source {uri[:80]!r}: use hf://ORG/NAME or hf://ORG/NAME@REVISION "
                "(REVISION: a branch, tag or commit)"
            )
        rev = m.group(2)
        return HfRef(m.group(1), "main" if rev is None else check_revision(rev))
    if scheme == "s3":
        m = _S3_RE.fullmatch(uri)
        if not m or "//" in uri[5:] or uri.endswith("/"):
            raise SourceURIError(
                f"bad s3:// source {uri[:80]!r}: use s3://BUCKET/PREFIX (bucket: 3-63 of "
                "[a-z0-9.-]; prefix: the model's folder, no trailing '/')"
            )
        return S3Ref(m.group(1), m.group(2))
    if scheme == "pvc":
        m = _PVC_RE.fullmatch(uri)
        if not m:
            raise SourceURIError(
                f"bad pvc:// source {uri[:80]!r}: use pvc://CLAIM or pvc://CLAIM/PATH (CLAIM: the "
                "PersistentVolumeClaim's name)"
            )
        return PvcRef(m.group("claim"), m.group("path").lstrip("/"))
    m = _FILE_RE.fullmatch(uri)
    if not m:
        raise SourceURIError(
            f"bad file:// source {uri[:80]!r}: use file:///ABSOLUTE/PATH (a directory on the node)"
        )
    return FileRef(m.group("path"))
