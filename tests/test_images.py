"""The container images' recipe, checked without a container engine (none here, and no access
to container registries for base images; docs/images.md): the CI builds the wheel and installs it
into a fresh virtual environment exactly as the Dockerfiles do (the same scripts, the same
pinned constraints), and resolves the CUDA agent image's pinned set (vLLM, torch, cuda-python)
for its Python and platform."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "images"
DOCKERFILES = {
    "operator": IMAGES / "warmserve.Dockerfile",
    "agent-cuda": IMAGES / "agent-cuda.Dockerfile",
}


def _run(*argv: str, timeout: float = 900) -> str:
    out = subprocess.run(
        list(argv), cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert out.returncode == 0, f"{argv} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.parametrize("flavor", sorted(DOCKERFILES))
def test_dockerfiles_are_multi_stage_non_root_pinned_and_use_the_checked_scripts(
    flavor: str,
) -> None:
    text = DOCKERFILES[flavor].read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE)
    assert len(froms) >= 2, "multi-stage: a build stage and a runtime stage"
    bases = re.findall(r"^ARG \w+_IMAGE=(\S+)$", text, re.MULTILINE)
    assert bases and all(re.search(r":\d+\.\d+\.\d+-", b) for b in bases), bases  # x.y.z tags
    assert "latest" not in text
    for folder in ("warmserve", "operator", "agent", "gateway"):  # every package's sources
        assert f"COPY {folder} ./{folder}" in text, folder
    assert re.search(r"^USER 65532:65532$", text, re.MULTILINE), "runs as the chart's uid"
    # The exact commands tests below run:
    assert "images/build-wheel.sh /wheels" in text
    assert f"images/install.sh {flavor} /opt/warmserve /wheels" in text


def test_chart_defaults_point_at_the_images() -> None:
    import yaml

    values = yaml.safe_load((ROOT / "helm" / "warmserve" / "values.yaml").read_text())
    assert values["image"]["repository"].endswith("/warmserve")
    assert values["agent"]["image"]["repository"].endswith("/warmserve-agent-cuda")
    for flavor, path in DOCKERFILES.items():
        name = "warmserve" if flavor == "operator" else "warmserve-agent-cuda"
        assert f"-t REGISTRY/{name}:" in path.read_text(), path


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    whl = _run(str(IMAGES / "build-wheel.sh"), str(out)).strip().splitlines()[-1]
    assert Path(whl).name == "warmserve-0.1.0-py3-none-any.whl"
    return out


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_as_the_operator_image_does(
    tmp_path: Path, wheels: Path
) -> None:
    _run(str(IMAGES / "install.sh"), "operator", str(tmp_path / "venv"), str(wheels))
    venv = tmp_path / "venv" / "bin"
    assert "warmserve 0.1.0" in _run(str(venv / "warmserve"), "--version")
    _run(str(venv / "warmserve"), "operator", "--help")
    _run(str(venv / "warmserve"), "agent", "--help")
    _run(str(venv / "warmserve"), "gateway", "--help")
    # Every pin of the constraints file is what got installed.
    frozen = {
        ln.split("==")[0].lower().replace("_", "-"): ln.split("==")[1]
        for ln in _run(str(venv / "pip"), "freeze").splitlines()
        if "==" in ln
    }
    pins = {
        ln.split("==")[0].lower().replace("_", "-"): ln.split("==")[1]
        for ln in (IMAGES / "constraints-operator.txt").read_text().splitlines()
        if "==" in ln and not ln.startswith("pip==")
    }
    wrong = {k: (v, frozen.get(k)) for k, v in pins.items() if frozen.get(k) != v}
    assert not wrong, f"installed versions differ from the pins: {wrong}"


@pytest.mark.slow
def test_the_cuda_agent_image_pins_resolve_for_its_platform(tmp_path: Path, wheels: Path) -> None:
    out = _run(
        str(IMAGES / "install.sh"),
        "agent-cuda",
        str(tmp_path / "venv"),
        str(wheels),
        "--resolve-only",
    )
    assert "resolved agent-cuda for CPython 3.12" in out
    pins = (IMAGES / "constraints-agent-cuda.txt").read_text()
    for pkg in ("vllm==0.32.0", "cuda-python==13.4.4", "torch==", "boto3==", "huggingface_hub=="):
        assert re.search(rf"^{re.escape(pkg)}", pins, re.MULTILINE), pkg
