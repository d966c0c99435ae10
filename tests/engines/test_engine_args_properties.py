"""Property: whatever argument list the validator accepts sets only allowlisted dests (and only
allowed keys of a JSON config), read by an independent model of vLLM's parser; whatever it
refuses, it refuses naming one of the list's tokens."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st

from tests.engines.engine_args_strategies import arg_lists, json_keys, model_parse, rule_keys
from warmserve.engine_args import (
    DEFAULT_POLICY,
    EngineArgPolicy,
    EngineArgsError,
    load_schema,
    validate_engine_args,
)

WIDENED = EngineArgPolicy.from_admin(
    ["kv_events_config", "tokenizer", "disable_log_stats"], ["compilation_config"]
)
SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check(args: list[str], policy: EngineArgPolicy) -> bool:
    """True when accepted (and then checked)."""
    try:
        validate_engine_args(args, policy)
    except EngineArgsError as exc:
        assert any(t == exc.arg or t.partition("=")[0] == exc.arg for t in args), (exc, args)
        return False
    assert "--config" not in args  # vLLM's parser would read a YAML file for it
    parsed = model_parse(args)
    note(f"parsed: {parsed}")
    if parsed is None:  # the (modelled) vLLM parser refuses it: nothing runs
        return True
    allowed = policy.allowed_dests(load_schema().dests)
    assert set(parsed) <= allowed, (args, set(parsed) - allowed)
    for dest, value in parsed.items():
        keys = rule_keys(dest)
        if keys is not None and dest not in policy.unsafe:
            assert json_keys(value) <= keys, (args, dest, value)
    return True


@SETTINGS
@given(arg_lists())
@example(["-cc.mode=3", "--compilation-config.cudagraph_capture_sizes", "[1, 2]"])
@example(["--override-generation-config", '{"temperature": 0.5}', "--seed", "-1"])
def test_accepted_lists_set_only_allowlisted_dests(args: list[str]) -> None:
    _check(args, DEFAULT_POLICY)


@SETTINGS
@given(arg_lists(WIDENED))
def test_widening_adds_only_what_the_admin_named(args: list[str]) -> None:
    _check(args, WIDENED)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from(sorted(DEFAULT_POLICY.allowed_dests(load_schema().dests)))))
def test_allowed_dests_are_tenant_or_widened(dests: list[str]) -> None:
    from warmserve.engine_arg_policy import CODE, MANAGED, TENANT

    for d in dests:
        assert d in TENANT and d not in CODE and d not in MANAGED
