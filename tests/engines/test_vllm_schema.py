"""The shipped engine-args schema against the installed vLLM (group ``vllm``): no drift, what
warmserve accepts/refuses matches vLLM's own parser, and whatever the tenant allowlist lets
through sets only allowlisted dests in vLLM's own parser."""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings

from tests.engines.engine_args_strategies import arg_lists, json_keys, rule_keys
from tests.engines.test_engine_args import BAD, GOOD, REFUSED
from warmserve.engine_args import (
    DEFAULT_POLICY,
    MANAGED,
    EngineArgsError,
    load_schema,
    parse_engine_args,
)

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _parser() -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(exit_on_error=False)
    AsyncEngineArgs.add_cli_args(parser)
    return parser


def _vllm_parse(args: list[str]) -> dict[str, Any] | None:
    """What vLLM's parser sets, as {dest: value} differing from a bare ``--model m``."""
    try:
        ns = vars(_parser().parse_args(["--model", "m", *args]))
    except (SystemExit, Exception):
        return None
    base = vars(_parser().parse_args(["--model", "m"]))
    return {k: v for k, v in ns.items() if v != base.get(k)}


def _vllm_accepts(args: list[str]) -> bool:
    return _vllm_parse(args) is not None


def test_shipped_schema_matches_installed_vllm() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "hack/vllm/gen-engine-args.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.parametrize(("args", "want"), GOOD)
def test_vllm_accepts_what_warmserve_accepts(args: list[str], want: dict) -> None:
    parse_engine_args(args)
    assert _vllm_accepts(args)


@pytest.mark.parametrize(("args", "name"), BAD)
def test_vllm_refuses_what_warmserve_refuses(args: list[str], name: str) -> None:
    with pytest.raises(EngineArgsError):
        parse_engine_args(args)
    flag = name.lstrip("-").replace("-", "_")
    if flag in MANAGED:  # valid for vLLM; warmserve sets it itself
        assert _vllm_accepts(args)
    else:
        assert not _vllm_accepts(args)


@pytest.mark.parametrize(("args", "name"), REFUSED)
def test_what_tenants_may_not_set_is_valid_for_vllm(args: list[str], name: str) -> None:
    """The allowlist refuses these, not vLLM's syntax: without it they would reach vLLM."""
    with pytest.raises(EngineArgsError):
        parse_engine_args(args)
    assert _vllm_accepts(args)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arg_lists())
@example(["-cc.mode=3", "--compilation-config.cudagraph_capture_sizes", "[1, 2]"])
@example(["-cc", '{"mode": 3, "cudagraph_mode": "PIECEWISE"}', "--max_model_len", "2k"])
@example(["--override-generation-config.temperature", "0.2", "--no-enforce-eager"])
def test_vllms_parser_sets_only_allowlisted_dests(args: list[str]) -> None:
    try:
        parse_engine_args(args)
    except EngineArgsError:
        return
    parsed = _vllm_parse(args)
    if parsed is None:  # vLLM refuses it: nothing starts
        return
    allowed = DEFAULT_POLICY.allowed_dests(load_schema().dests)
    assert set(parsed) <= allowed, (args, set(parsed) - allowed)
    for dest, value in parsed.items():
        keys = rule_keys(dest)
        if keys is None:
            continue
        if dataclasses.is_dataclass(value):  # e.g. CompilationConfig: the fields set
            default = type(value)()
            changed = {
                f.name
                for f in dataclasses.fields(value)
                if getattr(value, f.name) != getattr(default, f.name)
            }
            assert changed <= keys, (args, changed - keys)
        else:
            assert json_keys(value if isinstance(value, str) else dict(value)) <= keys
