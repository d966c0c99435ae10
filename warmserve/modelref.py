"""Model names and model source URIs: the one definition the CRD, the operator and the agent share.

**Names** (``spec.model.name``; the key of a model everywhere: policy, agent store, metrics):
1-200 characters, one or two ``/``-separated parts of ``[A-Za-z0-9._-]`` each starting with a
letter or digit (``llama-3-8b``, ``meta-llama/Llama-3.1-8B-Instruct``).  In a node's weight store
a name is a directory path (``<store>/meta-llama/Llama-3.1-8B-Instruct``); no part can be ``..``.
The CRD's OpenAPI pattern and maxLength are the same rule (a test compares them).

**Sources** (``spec.model.source``, optional; where an agent fetches a model its store lacks):

==============================  ==========================================================
``hf://ORG/NAME[@REVISION]``    a Hugging Face Hub model repo (branch, tag or commit;
                                default ``main``), via ``huggingface_hub``
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
    "parse_source",
]

MODEL_NAME_MAX = 200
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
# Exactly the CRD's pattern for spec.model.name.
MODEL_NAME_PATTERN = rf"^{_PART}(/{_PART})?$"
_NAME_RE = re.compile(MODEL_NAME_PATTERN)

SOURCE_MAX = 1024
_HF_RE = re.compile(rf"^hf://({_PART}/{_PART})(?:@([A-Za-z0-9][A-Za-z0-9._/-]*))?$")
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
    if not _NAME_RE.match(name):
        raise SourceURIError(
            f"malformed model name {name[:MODEL_NAME_MAX]!r}: use NAME or ORG/NAME, each part of "
            "[A-Za-z0-9._-] starting with a letter or digit (e.g. meta-llama/Llama-3.1-8B)"
        )
    return name


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
        m = _HF_RE.match(uri)
        if not m:
            raise SourceURIError(
                f"bad hf:// source {uri[:80]!r}: use hf://ORG/NAME or hf://ORG/NAME@REVISION "
                "(REVISION: a branch, tag or commit)"
            )
        return HfRef(m.group(1), m.group(2) or "main")
    if scheme == "s3":
        m = _S3_RE.match(uri)
        if not m or "//" in uri[5:] or uri.endswith("/"):
            raise SourceURIError(
                f"bad s3:// source {uri[:80]!r}: use s3://BUCKET/PREFIX (bucket: 3-63 of "
                "[a-z0-9.-]; prefix: the model's folder, no trailing '/')"
            )
        return S3Ref(m.group(1), m.group(2))
    if scheme == "pvc":
        m = _PVC_RE.match(uri)
        if not m:
            raise SourceURIError(
                f"bad pvc:// source {uri[:80]!r}: use pvc://CLAIM or pvc://CLAIM/PATH (CLAIM: the "
                "PersistentVolumeClaim's name)"
            )
        return PvcRef(m.group("claim"), m.group("path").lstrip("/"))
    m = _FILE_RE.match(uri)
    if not m:
        raise SourceURIError(
            f"bad file:// source {uri[:80]!r}: use file:///ABSOLUTE/PATH (a directory on the node)"
        )
    return FileRef(m.group("path"))
