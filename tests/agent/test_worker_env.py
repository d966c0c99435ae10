"""The environment a GPU worker process starts with: built from an allowlist, offline, without
the agent's secrets (read from /proc of a real worker process)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from warmserve_agent.worker import WorkerHandle

SECRETS = {
    "HF_TOKEN": "hf_secret",
    "HUGGING_FACE_HUB_TOKEN": "hf_secret",
    "AWS_ACCESS_KEY_ID": "AKIASECRET",
    "AWS_SECRET_ACCESS_KEY": "aws-secret",
    "AWS_SESSION_TOKEN": "aws-session",
    "AWS_ENDPOINT_URL_S3": "http://s3.internal:9000",
    "GOOGLE_APPLICATION_CREDENTIALS": "/var/secrets/gcp.json",
    "KUBERNETES_SERVICE_HOST": "10.0.0.1",
    "KUBERNETES_SERVICE_PORT": "443",
    "WARMSERVE_AGENT_TOKEN_FILE": "/var/run/secrets/warmserve/token",
    "POD_NAMESPACE": "warmserve",
    "HTTPS_PROXY": "http://proxy:3128",
    "VLLM_API_KEY": "vllm-secret",
    "SOMETHING_ELSE": "x",
}


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode().split("\0") if "=" in kv)


def test_worker_process_starts_offline_without_the_agents_secrets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the agent's own value does not reach it
    h = WorkerHandle(engines=("simulated",))
    try:
        info = h.wait_ready(timeout_s=120)
        assert info["pid"] == h.pid and info["engines"] == ["simulated"]
        env = _environ(h.pid)
        leaked = sorted(k for k in SECRETS if k in env)
        assert not leaked, f"the worker inherited {leaked}"
        assert not [v for v in env.values() if "secret" in v.lower()]
        for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
            assert env[k] == "1", k
        assert env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"
        assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["PATH"] == os.environ["PATH"]
        # nor the agent's command line (its TLS key and token file paths)
        cmdline = Path(f"/proc/{h.pid}/cmdline").read_bytes().split(b"\0")
        assert not [a for a in cmdline if a.startswith(b"--")], cmdline
    finally:
        h.stop()
    assert not h.alive()


def test_the_allowlist() -> None:
    from warmserve_agent.worker_env import passes, worker_environ

    for name in (
        "PATH",
        "HOME",
        "LD_LIBRARY_PATH",
        "CUDA_VISIBLE_DEVICES",
        "NCCL_DEBUG",
        "OMP_NUM_THREADS",
        "VLLM_ATTENTION_BACKEND",
        "LC_ALL",
        "WARMSERVE_UP_STACK",
        "WARMSERVE_FAKE_CUDA_MEM",
    ):
        assert passes(name), name
    for name in (
        "HF_TOKEN",
        "AWS_ACCESS_KEY_ID",
        "VLLM_API_KEY",
        "NCCL_SOCKET_PASSWORD",
        "TORCH_AUTH_TOKEN",
        "KUBERNETES_SERVICE_HOST",
        "KUBECONFIG",
        "http_proxy",
        "SSL_CERT_FILE",
        "HF_HOME",
        "PYTHONPATH",
        "LD_PRELOAD",
        "WARMSERVE_AGENT_TOKEN_FILE",
    ):
        assert not passes(name), name
    env = worker_environ({"PATH": "/bin", "HF_HUB_OFFLINE": "0"}, ["", "/a", "/b"])
    assert env["PYTHONPATH"] == os.pathsep.join(["/a", "/b"]) and env["HF_HUB_OFFLINE"] == "1"
