"""``warmserve up --engine vllm`` end to end (group ``vllm``: hack/test.sh runs it with the python
of hack/vllm/setup.sh): a short replay (5 trace minutes at 20x: 45 s warm-up + 15 s measured) of the
two real models on real vLLM behind the whole local stack; every request answered, real answers
through the gateway, instances started on prewarmed slots; then ``warmserve down`` leaves no
process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.local.up_support import warmserve
from warmserve.local import procs

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def test_up_engine_vllm_serves_real_tokens_and_down_leaves_nothing(
    k8s_bin_dir: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    port = procs.free_port("0.0.0.0")
    env = {
        **os.environ,
        "WARMSERVE_K8S_BIN": str(k8s_bin_dir),
        "WARMSERVE_VLLM_PYTHON": sys.executable,
    }
    env.pop("KUBECONFIG", None)
    stack: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        up = warmserve(
            "up", "--engine", "vllm", "--minutes", "5", "--plain", "--port", str(port),
            "--state-dir", str(state), env=env, timeout=780,
        )  # fmt: skip
        wall = time.monotonic() - t0
        print(up.stdout[-5000:])
        assert up.returncode == 0, up.stdout[-4000:] + up.stderr
        assert "engine: vllm (CPU); real models: smollm2, smollm2-b" in up.stdout
        stack = json.loads((state / "stack.json").read_text())
        (run_dir,) = sorted((state / "runs").iterdir())
        results = [json.loads(x) for x in (run_dir / "requests-warmserve.jsonl").open()]
        assert [r for r in results if r["outcome"] == "dropped"] == []
        assert len([r for r in results if r["outcome"] == "ok"]) >= 5, results
        report = (run_dir / "report.md").read_text()
        for model in ("smollm2", "smollm2-b"):  # real answers, through the gateway
            assert f"answer of {model}" in report
        assert report.count("Paris") >= 2, report
        # the agents ran vLLM under the venv's python; the deployments name the vllm engine
        agent = next(d for d in (state / "pods").iterdir() if "-agent-" in d.name)
        assert (agent / "argv").read_text().splitlines()[0] == sys.executable
        assert "--engines=simulated,vllm" in (agent / "argv").read_text()
        kubectl = [str(k8s_bin_dir / "kubectl"), "--kubeconfig", stack["info"]["kubeconfig"]]
        mds = json.loads(
            subprocess.run(
                [*kubectl, "get", "wsmd", "-o", "json"], capture_output=True, text=True, check=True
            ).stdout
        )["items"]
        assert {md["spec"]["engine"]["name"] for md in mds} == {"vllm"}
        hits = sum((md.get("status") or {}).get("prewarm", {}).get("hits", 0) for md in mds)
        assert hits >= 1, [md.get("status", {}).get("prewarm") for md in mds]
        print(f"warmserve up --engine vllm wall time: {wall:.0f}s; hits {hits}")
    finally:
        down = warmserve("down", "--state-dir", str(state), env=env, timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert stack, "the stack never started"
    assert procs.marked(stack["id"]) == []
    assert not (state / "stack.json").exists()
