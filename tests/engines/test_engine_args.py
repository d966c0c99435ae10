"""spec.engine.args: vLLM's engine arguments validated without vLLM (shipped schema).

The same cases run against vLLM's real parser in test_vllm_schema.py (vllm group)."""

from __future__ import annotations

import pytest
from warmserve_operator.engine import parse_engine, ttft_report
from warmserve_operator.spec import SpecError

from warmserve.engine_args import (
    EngineArgsError,
    load_schema,
    parse_engine_args,
    validate_engine_args,
)

# (args, dest -> value) that vLLM accepts
GOOD = [
    (["--max-model-len", "256"], {"max_model_len": 256}),
    (["--max-model-len=256"], {"max_model_len": 256}),
    (["--max_model_len", "2k"], {"max_model_len": "2k"}),
    (["--enforce-eager"], {"enforce_eager": True}),
    (["--no-enforce-eager"], {"enforce_eager": False}),
    (["--dtype", "float32"], {"dtype": "float32"}),
    (["--max-num-seqs", "4", "--enable-prefix-caching"], {"max_num_seqs": 4}),
    (["--compilation-config", '{"mode": 0}'], {}),
    (["--seed", "-1"], {"seed": -1}),
]
# (args, the argument the error must name)
BAD = [
    (["--max-model-lenn", "256"], "--max-model-lenn"),
    (["--max-model-len", "lots"], "--max-model-len"),
    (["--dtype", "float8"], "--dtype"),
    (["--enforce-eager=maybe"], "--enforce-eager"),
    (["--max-model-len"], "--max-model-len"),
    (["256"], "256"),
    (["--model", "other"], "--model"),
    (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size"),
    (["--load-format", "safetensors"], "--load-format"),
]


def test_schema_is_vllms() -> None:
    s = load_schema()
    assert s.vllm_version and len(s.options) > 100
    assert "--max-model-len" in s.by_flag and "--no-enforce-eager" in s.by_flag


@pytest.mark.parametrize(("args", "want"), GOOD)
def test_good_args_parse(args: list[str], want: dict) -> None:
    got = parse_engine_args(args)
    for k, v in want.items():
        assert got[k] == v


@pytest.mark.parametrize(("args", "name"), BAD)
def test_bad_args_are_refused_naming_the_argument(args: list[str], name: str) -> None:
    with pytest.raises(EngineArgsError) as e:
        validate_engine_args(args)
    assert e.value.arg == name
    assert name in str(e.value)


def test_operator_refuses_at_admission_naming_the_argument() -> None:
    with pytest.raises(SpecError, match="--max-model-lenn"):
        parse_engine({"engine": {"args": ["--max-model-lenn", "4"]}})
    with pytest.raises(SpecError, match=r"spec\.engine\.name"):
        parse_engine({"engine": {"name": "tgi"}})
    assert parse_engine({"engine": {"name": "vllm", "args": ["--enforce-eager"]}}) == (
        "vllm",
        ("--enforce-eager",),
    )
    assert parse_engine({}) == ("", ())


def test_ttft_report() -> None:
    status, cond = ttft_report([], 1.0)
    assert cond[1] is None and status["samples"] == 0
    status, cond = ttft_report([(0.2, 10, 300.0), (0.0, 0, 300.0)], 1.0)
    assert cond[1] is True and status["observedP95Seconds"] == 0.2
    status, (_, met, reason, message) = ttft_report([(0.2, 10, 300.0), (1.5, 3, 300.0)], 1.0)
    assert met is False and reason == "ObjectiveMissed"
    assert status["samples"] == 13 and status["observedP95Seconds"] == 1.5
    assert "exceeds the objective 1s" in message


def test_engine_names_match_the_agent_registry() -> None:
    from warmserve_agent.engines import ENGINES

    from warmserve.engine_args import ENGINE_NAMES

    assert set(ENGINE_NAMES) == set(ENGINES)
