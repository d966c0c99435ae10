"""``warmserve up --engine vllm`` without starting anything: the flag's checks (one line, exit
status 2, nothing started, the hint how to get vLLM), and what the vllm scenario asks of the
stack (real models only, their engine and arguments, requests capped to the model's context,
agents hosting vllm).  The run itself is in the vllm group (test_up_vllm.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.local.test_up_cli import one_line_error
from tests.local.up_support import warmserve
from warmserve.local.model_mix import UpConfigError, load_default, model_deployments, parse
from warmserve.local.workload import plan


def _env(python: str) -> dict[str, str]:
    return {**os.environ, "WARMSERVE_VLLM_PYTHON": python}


def test_engine_vllm_without_vllm_is_one_line_with_the_hint(tmp_path: Path) -> None:
    # this venv's python has no vllm module (the core install stays small)
    p = warmserve("up", "--engine", "vllm", "--state-dir", str(tmp_path), env=_env(sys.executable))
    line = one_line_error(p, "has no vllm module", "hack/vllm/setup.sh", "simulated engine")
    assert "5 GB" in line
    assert not (tmp_path / "stack.json").exists()
    p = warmserve(
        "up", "--engine", "vllm", "--state-dir", str(tmp_path), env=_env(str(tmp_path / "nope"))
    )
    one_line_error(p, "no vLLM python at WARMSERVE_VLLM_PYTHON=", "hack/vllm/setup.sh")
    assert not (tmp_path / "stack.json").exists()


def test_unknown_engine_is_refused(tmp_path: Path) -> None:
    p = warmserve("up", "--engine", "tgi", "--state-dir", str(tmp_path))
    assert p.returncode == 2 and "invalid choice: 'tgi'" in p.stderr, p.stderr


def test_the_vllm_scenario_serves_the_real_models_only() -> None:
    mix = load_default("vllm")
    assert mix.engine == "vllm" and mix.byte_scale == 1
    assert [(m.name, m.real) for m in mix.models] == [
        ("smollm2", "smollm2"),
        ("smollm2-b", "smollm2"),
    ]
    mds = model_deployments(mix, "warmserve", prewarm=True)
    for md in mds:
        assert md["spec"]["engine"] == {
            "name": "vllm",
            "args": ["--enforce-eager", "--max-model-len=512"],
        }
        assert md["spec"]["model"]["coldStartSeconds"] > 30  # the load plus vLLM's build
    # the simulated scenario is unchanged: no engine named, the agents' default
    assert all(
        "engine" not in md["spec"] for md in model_deployments(load_default(), "w", prewarm=True)
    )


def test_requests_are_capped_to_what_the_real_model_serves() -> None:
    mix = load_default("vllm")
    p = plan(mix, mix.arrivals, 20.0, 10.0)
    assert len(p) > 0
    assert int(np.max(p.input_tokens)) <= 96 and int(np.max(p.output_tokens)) <= 24
    assert int(np.max(plan(load_default(), mix.arrivals, 20.0, 10.0).input_tokens)) > 96


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        ({"engine": "tgi"}, "engine must be one of simulated, vllm"),
        ({"engine": "simulated"}, "real models need engine: vllm"),
        ({"max_output_tokens": -1}, "must be >= 0"),
    ],
)
def test_bad_vllm_scenarios(edit: dict[str, object], needle: str) -> None:
    from importlib import resources

    import yaml

    doc = yaml.safe_load(
        (resources.files("warmserve.data") / "examples" / "up-vllm.yaml").read_text()
    )
    with pytest.raises(UpConfigError, match=needle):
        parse({**doc, **edit})


def test_the_agents_host_vllm_with_the_vllm_scenario(tmp_path: Path) -> None:
    from warmserve.local.stack import values

    mix = load_default("vllm")
    p = plan(mix, mix.arrivals, 20.0, 10.0)
    agent = values(mix, p, 2, 1.0, tmp_path)["agent"]
    assert agent["engines"] == "simulated,vllm" and agent["simulateGpus"] == "2x1024MiB"
    assert not any(a.startswith("--page-size") for a in agent["extraArgs"])
    assert values(load_default(), p, 8, 80.0, tmp_path)["agent"]["engines"] == "simulated"
