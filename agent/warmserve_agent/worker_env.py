"""The environment of a GPU worker process: built from an allowlist, offline, without secrets.

The worker hosts the engine (vLLM and whatever it imports), next to every tenant's weights, so it
gets only what an engine needs to run: the interpreter's and the GPU stack's settings.  Not the
Hugging Face token, S3/cloud credentials, the Kubernetes service account's or the API server's
variables, the pod's identity, proxies, or any other variable the agent was started with.
Fetching models is the agent's job (``warmserve_agent.sources``); the engine reads the weights
the agent put in the slot, so the worker runs with the Hub and vLLM's usage reporting switched
off.  A variable passes when its exact name is in :data:`PASS` or it starts with one of
:data:`PASS_PREFIXES` and names no secret (:data:`SECRET_MARKS`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

# Passed on by exact name: the process basics, the dynamic loader, the interpreter, caches.
PASS = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TERM",
        "TMPDIR",
        "TEMP",
        "TMP",
        "LD_LIBRARY_PATH",
        "VIRTUAL_ENV",
        "PYTHONUNBUFFERED",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONHASHSEED",
        "PYTHONFAULTHANDLER",
        "PYTHONWARNINGS",
        "XDG_CACHE_HOME",
        "CC",  # the native helper's compiler (warmserve_agent.native)
    }
)
# Passed on by prefix: warmserve's own settings (WARMSERVE_NATIVE_CACHE; WARMSERVE_UP_STACK, by
# which `warmserve down` finds the local stack's processes; the tests' fake CUDA driver's size),
# locale, the GPU stack and the engine's own tuning.
PASS_PREFIXES = (
    "WARMSERVE_",
    "LC_",
    "CUDA_",
    "NVIDIA_",
    "NCCL_",
    "OMP_",
    "MKL_",
    "KMP_",
    "TORCH_",
    "TORCHINDUCTOR_",
    "PYTORCH_",
    "TRITON_",
    "VLLM_",
)
# ... unless the name says it holds a secret (VLLM_API_KEY, WARMSERVE_AGENT_TOKEN_FILE, a *_TOKEN).
SECRET_MARKS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "KEY", "AUTH")
# Set in every worker: no Hub access, no telemetry (the agent fetched the weights already).
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "DO_NOT_TRACK": "1",
}


def passes(name: str) -> bool:
    """Whether the agent's variable ``name`` reaches a worker."""
    if name in PASS:
        return True
    if not name.startswith(PASS_PREFIXES):
        return False
    upper = name.upper()
    return not any(mark in upper for mark in SECRET_MARKS)


def worker_environ(parent: Mapping[str, str], python_path: Sequence[str]) -> dict[str, str]:
    """The environment of a worker started by an agent with environment ``parent``;
    ``python_path``: where the worker finds warmserve and the engines (the agent's sys.path)."""
    env = {k: v for k, v in parent.items() if passes(k)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in python_path if p)
    env.update(OFFLINE)
    return env
