"""The agent's model profile on real vLLM (CPU): after a prewarm and an Activate, ``Describe``
reports the loader's rate, the activation and a forward timed on vLLM's own OpenAI server, at the
longest probe prompt the engine's ``--max-model-len`` takes."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

PAGE = 64 * 1024
GPU = 48 * 1024**2


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from warmserve_agent.engines.vllm.tiny import make_tiny_llama

    root = tmp_path_factory.mktemp("models")
    make_tiny_llama(root / "tiny", layers=4, hidden=128, seed=7)
    return root


def test_vllm_forward_is_timed_and_reported(tmp_path: Path, tiny_root: Path) -> None:
    import time

    from warmserve_agent.config import AgentConfig
    from warmserve_agent.model_profile import PROBE_PROMPT_TOKENS
    from warmserve_agent.testing import AgentThread

    from warmserve.api.agent.client import SyncAgentClient

    cfg = AgentConfig(
        model_dir=tiny_root,
        simulate_gpus=[GPU],
        listen="127.0.0.1:0",
        page_bytes=PAGE,
        memory_dir=tmp_path / "mem",
        spare_workers=0,
        memory_in_workers=True,
        engines=("vllm", "simulated"),
    )
    with AgentThread(cfg) as agent, SyncAgentClient(agent.address) as client:
        for _ in client.prewarm("tiny", [0], 2):
            pass
        # a context of 64 tokens: the 128-token probe is refused by vLLM, the 32-token one runs
        res = client.activate(
            "tiny", [0], engine="vllm", engine_args=["--enforce-eager", "--max-model-len", "64"]
        )
        assert res.prewarm_hit
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            (m,) = [m for m in client.describe().models if m.name == "tiny"]
            if m.profile.compute_tp:
                break
            time.sleep(0.2)
        p = m.profile
        assert p.compute_tp == 1 and p.prompt_tokens == PROBE_PROMPT_TOKENS[1] == 32, p
        # a 4-layer, 128-wide model: its forward may be below what a request's timing resolves
        assert 0 <= p.layer_compute_seconds < 1.0, p
        assert p.load_bytes_per_second > 0
        assert p.head_start_seconds == pytest.approx(res.activation_seconds, rel=1e-6)
        print(
            f"tiny llama on vLLM (CPU): {p.layer_compute_seconds * 1e3:.3f} ms per layer for "
            f"{p.prompt_tokens} tokens, load {p.load_bytes_per_second / 1e6:.1f} MB/s per GPU, "
            f"head start {p.head_start_seconds:.2f} s"
        )
