"""The shipped engine-args schema against the installed vLLM (group ``vllm``): no drift, and
what warmserve accepts/refuses matches vLLM's own parser."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines.test_engine_args import BAD, GOOD
from warmserve.engine_args import MANAGED, EngineArgsError, parse_engine_args

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]


def _vllm_accepts(args: list[str]) -> bool:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(exit_on_error=False)
    AsyncEngineArgs.add_cli_args(parser)
    try:
        parser.parse_args(["--model", "m", *args])
    except (SystemExit, Exception):
        return False
    return True


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
