"""The chart's engineArgs values reach the operator and every agent as the same flags, and the
CLIs turn them into the same engine-argument policy (or refuse to start, naming the value)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helm.test_chart import CHART, _find, _helm, _parse_cli, _render
from warmserve.engine_args import DEFAULT_POLICY
from warmserve.flags import CliError
from warmserve.flags import engine_args as engine_arg_flags


def _args(docs: list[dict[str, Any]]) -> dict[str, list[str]]:
    objs = {"operator": ("Deployment", "-operator"), "agent": ("DaemonSet", "-agent")}
    return {
        who: _find(docs, kind, suffix)["spec"]["template"]["spec"]["containers"][0]["args"]
        for who, (kind, suffix) in objs.items()
    }


def test_default_is_the_tenant_allowlist(k8s_bin_dir: Path) -> None:
    for args in _args(_render(k8s_bin_dir)).values():
        assert not [a for a in args if "engine-arg" in a]
        assert engine_arg_flags.policy(_parse_cli(args)) == DEFAULT_POLICY


def test_widening_reaches_operator_and_agents_alike(k8s_bin_dir: Path) -> None:
    docs = _render(
        k8s_bin_dir,
        "--set-json",
        'engineArgs.extraAllowed=["kv_events_config", "--limit-mm-per-prompt"]',
        "--set-json",
        'engineArgs.unsafeAllowCodeExecution=["trust_remote_code"]',
    )
    policies = set()
    for args in _args(docs).values():
        assert "--allow-engine-arg=kv_events_config" in args
        assert "--unsafe-allow-code-engine-arg=trust_remote_code" in args
        policies.add(engine_arg_flags.policy(_parse_cli(args)))
    (policy,) = policies
    assert policy.extra == {"kv_events_config", "limit_mm_per_prompt"}
    assert policy.unsafe == {"trust_remote_code"}


def test_code_execution_needs_the_unsafe_value(k8s_bin_dir: Path) -> None:
    docs = _render(k8s_bin_dir, "--set-json", 'engineArgs.extraAllowed=["trust_remote_code"]')
    for args in _args(docs).values():  # the pods would stop at start with this message
        with pytest.raises(CliError, match="only --unsafe-allow-code-engine-arg trust_remote_code"):
            engine_arg_flags.policy(_parse_cli(args))


@pytest.mark.parametrize(
    "value",
    ['engineArgs.extraAllowed=["a b"]', 'engineArgs.extraAllowed="tokenizer"', "engineArgs.x=1"],
)
def test_malformed_values_fail_to_render(k8s_bin_dir: Path, value: str) -> None:
    proc = _helm(k8s_bin_dir, "template", "ws", str(CHART), "--set-json", value, check=False)
    assert proc.returncode != 0 and "engineArgs" in proc.stderr
