#!/usr/bin/env python3
"""The wheel list of hack/gpu-check.sh (hack/gpu-wheels.txt): check it, fetch it, plan installs.

    python3 hack/gpu_wheels.py check [--wheels DIR] [--fetch] [--budget-mib 48]
        CPU side (CI runs it through ``hack/gpu-check.sh --dry-run``): every line well formed,
        wheels built for CPython 3.12 manylinux x86_64, total size within the budget, each
        pinned version satisfying its "needs" and pyproject.toml's requirement, every wheel's
        Requires-Dist met by the list or the image; with --fetch, downloads what DIR lacks
        (pip download) and verifies size and sha256 of every file.
    python3 hack/gpu_wheels.py plan --wheels DIR
        GPU side: prints the wheels to install (one path per line): those whose package is
        missing or older than "needs" in this Python; exits 2 if one of them is not in DIR.

Standard library only (plus ``packaging``, which pip vendors), so it runs on any GPU image.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
except ImportError:  # pragma: no cover - pip always vendors it
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
LIST = ROOT / "hack" / "gpu-wheels.txt"
TARGET_PY = "3.12"
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
]
_SHA = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    needs: str
    file: str
    size: int
    sha256: str

    def norm(self) -> str:
        return re.sub(r"[-_.]+", "-", self.name).lower()


def parse(path: Path = LIST) -> tuple[list[Wheel], list[str]]:
    wheels, image = [], []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("# image-provides:"):
            image = line.split(":", 1)[1].split()
            continue
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 5 or "==" not in parts[0]:
            raise SystemExit(f"{path}:{n}: expected 'name==version needs file bytes sha256'")
        name, version = parts[0].split("==")
        try:
            SpecifierSet(parts[1])
            size = int(parts[3])
        except Exception as exc:
            raise SystemExit(f"{path}:{n}: {exc}") from None
        if not _SHA.match(parts[4]):
            raise SystemExit(f"{path}:{n}: sha256 must be 64 hex digits")
        wheels.append(Wheel(name, version, parts[1], parts[2], size, parts[4]))
    return wheels, image


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _tags_ok(w: Wheel) -> str | None:
    """None if the file name is a wheel for CPython 3.12 on manylinux x86_64, else why not."""
    m = re.match(r"^(.+?)-(.+?)-(.+?)-(.+?)-(.+)\.whl$", w.file)
    if not m:
        return "not a wheel file name"
    dist, ver, py, abi, plat = m.groups()
    if re.sub(r"[-_.]+", "-", dist).lower() != w.norm() or ver != w.version:
        return f"file is {dist} {ver}, line says {w.name} {w.version}"
    pys = py.split(".")
    if not ({"cp312", "py3"} & set(pys) or any(p.startswith("cp3") and abi == "abi3" for p in pys)):
        return f"python tag {py}/{abi} does not run on CPython {TARGET_PY}"
    if plat != "any" and not any(p.endswith("x86_64") and "linux" in p for p in plat.split(".")):
        return f"platform {plat} is not linux x86_64"
    return None


def _pyproject_needs() -> dict[str, SpecifierSet]:
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {}
    for req in meta["dependencies"]:
        r = Requirement(req)
        out[re.sub(r"[-_.]+", "-", r.name).lower()] = r.specifier
    return out


def fetch(w: Wheel, into: Path) -> None:
    into.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    cmd += ["--only-binary=:all:", "--python-version", TARGET_PY, "--implementation", "cp"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd += ["-d", str(into), f"{w.name}=={w.version}"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"pip download {w.name}=={w.version} failed:\n{res.stderr[-2000:]}")


def check(wheels_dir: Path | None, do_fetch: bool, budget_mib: float) -> int:
    wheels, image = parse()
    problems = []
    total = sum(w.size for w in wheels)
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB (budget {budget_mib:.0f} MiB)")
    if total > budget_mib * 2**20:
        problems.append(f"total {total / 2**20:.1f} MiB exceeds the {budget_mib} MiB budget")
    py = _pyproject_needs()
    names = {w.norm() for w in wheels}
    for w in wheels:
        why = _tags_ok(w)
        if why:
            problems.append(f"{w.file}: {why}")
        if Version(w.version) not in SpecifierSet(w.needs):
            problems.append(f"{w.name}=={w.version} does not satisfy its own needs {w.needs}")
        if w.norm() in py and Version(w.version) not in py[w.norm()]:
            problems.append(f"{w.name}=={w.version} does not satisfy pyproject's {py[w.norm()]}")
        if w.norm() in py and str(py[w.norm()]) and SpecifierSet(w.needs) != py[w.norm()]:
            problems.append(f"{w.name}: needs {w.needs} but pyproject.toml says {py[w.norm()]}")
    if wheels_dir is not None:
        for w in wheels:
            path = wheels_dir / w.file
            if not path.is_file() and do_fetch:
                fetch(w, wheels_dir)
            if not path.is_file():
                problems.append(f"{path} is missing (hack/gpu-check.sh --fetch-wheels)")
                continue
            if path.stat().st_size != w.size or _sha256(path) != w.sha256:
                problems.append(f"{path}: size or sha256 differs from the list")
                continue
            with zipfile.ZipFile(path) as z:
                meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
                reqs = [
                    line.split(":", 1)[1].strip()
                    for line in z.read(meta).decode().splitlines()
                    if line.startswith("Requires-Dist:")
                ]
            env = {"python_version": TARGET_PY, "platform_system": "Linux", "extra": ""}
            env |= {"sys_platform": "linux", "platform_machine": "x86_64"}
            for req in reqs:
                r = Requirement(req)
                if r.marker is not None and not r.marker.evaluate(env):
                    continue
                dep = re.sub(r"[-_.]+", "-", r.name).lower()
                if dep in names:
                    pinned = next(x for x in wheels if x.norm() == dep)
                    if Version(pinned.version) not in r.specifier:
                        problems.append(f"{w.name} needs {req}; the list has {pinned.version}")
                elif dep not in image:
                    problems.append(f"{w.name} needs {dep}, neither listed nor image-provided")
        print(f"verified size and sha256 of {len(wheels)} files in {wheels_dir}")
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


def plan(wheels_dir: Path) -> int:
    wheels, image = parse()
    todo, missing = [], []
    for w in wheels:
        try:
            have = md.version(w.name)
        except md.PackageNotFoundError:
            have = None
        ok = have is not None and Version(have) in SpecifierSet(w.needs)
        print(
            f"{w.name:<24} {have or 'missing':<12} needs {w.needs:<12} "
            f"{'ok' if ok else 'install ' + w.version}",
            file=sys.stderr,
        )
        if ok:
            continue
        path = wheels_dir / w.file
        present = path.is_file() and path.stat().st_size == w.size
        fits = sys.version_info[:2] == (3, 12) or "cp312" not in w.file
        if present and fits:
            todo.append(path)
        else:
            missing.append(w)
    absent = []
    for dist in image:
        try:
            md.version(dist)
        except md.PackageNotFoundError:
            absent.append(dist)
    if absent:
        print(
            f"this Python lacks {', '.join(absent)} (expected in a GPU image; pip install them)",
            file=sys.stderr,
        )
    if missing:
        for w in missing:
            print(
                f"need {w.name}{w.needs} but {wheels_dir / w.file} is absent or does not fit "
                f"Python {sys.version.split()[0]}: run hack/gpu-check.sh --fetch-wheels where "
                f"PyPI is reachable, or pip install '{w.name}{w.needs}'",
                file=sys.stderr,
            )
        return 2
    for p in todo:
        print(p)
    return 1 if absent else 0


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="validate the list (CPU side)")
    c.add_argument("--wheels", type=Path, help="directory holding (or receiving) the wheels")
    c.add_argument("--fetch", action="store_true", help="download wheels the directory lacks")
    c.add_argument("--budget-mib", type=float, default=48.0)
    p = sub.add_parser("plan", help="wheels this Python needs installed (GPU side)")
    p.add_argument("--wheels", type=Path, required=True)
    args = ap.parse_args()
    if args.cmd == "check":
        return check(args.wheels, args.fetch, args.budget_mib)
    return plan(args.wheels)


if __name__ == "__main__":
    sys.exit(main())
