"""Hypothesis strategies of engine-argument lists, and an independent model of how vLLM's parser
reads them (stdlib argparse built from the shipped schema, with the preprocessing vLLM's
``FlexibleArgumentParser`` documents: ``_`` for ``-`` in names, ``--json-arg.key value``
collected into one JSON value per argument, ``key+`` appending a comma-split list).

Shared by the property test (without vLLM) and the ``vllm`` group, which asks vLLM's real
parser instead of the model."""

from __future__ import annotations

import argparse
import functools
import json
from typing import Any

from hypothesis import strategies as st

from warmserve.engine_arg_policy import TENANT
from warmserve.engine_args import DEFAULT_POLICY, EngineArgPolicy, Option, load_schema

VALUES = [
    "0", "1", "16", "-1", "-7", "2k", "auto", "vllm", "awq", "fp8", "mistral", "custom",
    "x/y", "/etc", "evil.Cls", "http://h:4317", "FULL", "true", "0.5",
    '{"mode": 3}', '{"backend": "evil.fn"}', '{"temperature": 0.5}', '{"method": "custom_class"}',
    '{"kv_connector_module_path": "evil"}', "[1, 2]", "-q", "--config", "-1.5", "--",
]  # fmt: skip
KEYS = ["mode", "cudagraph_mode", "cudagraph_capture_sizes", "backend", "model", "temperature",
        "method", "pass_config.fuse_norm_quant", "custom_ops+", "kv_connector_module_path",
        "pylogging_config_file"]  # fmt: skip


def _flags(o: Option) -> list[str]:
    out = []
    for f in o.flags:
        out.append(f)
        if f.startswith("--"):
            out.append("--" + f[2:].replace("-", "_"))
            if o.kind == "bool_optional":
                out.append("--no-" + f[2:])
    return out


@st.composite
def _token_group(draw: st.DrawFn, options: list[Option]) -> list[str]:
    o = draw(st.sampled_from(options))
    flag = draw(st.sampled_from(_flags(o)))
    typed = {"int": ["0", "1", "16", "-1", "2k"], "float": ["0.5", "1"]}.get(o.kind, VALUES)
    typed = list(o.choices) if o.choices else typed
    value = st.one_of(st.sampled_from(typed), st.sampled_from(typed), st.sampled_from(VALUES))
    if o.kind in ("json", "str") and draw(st.booleans()) and not flag.startswith("--no-"):
        ours = sorted(rule_keys(o.dest) or ())
        key = f"{flag}.{draw(st.sampled_from(KEYS + ours * 3))}"
        v = draw(st.sampled_from(["1", "3", "[1, 2]", "PIECEWISE", "0.5"]) | value)
        return [f"{key}={v}"] if draw(st.booleans()) else [key, v]
    if not o.takes_value:
        return [flag] if draw(st.integers(0, 9)) else [f"{flag}=true"]
    if draw(st.booleans()):
        return [f"{flag}={draw(value)}"]
    n = draw(st.integers(1, 3)) if o.nargs in ("+", "*") else 1
    return [flag, *(draw(value) for _ in range(n))]


@st.composite
def arg_lists(draw: st.DrawFn, policy: EngineArgPolicy = DEFAULT_POLICY) -> list[str]:
    """Lists that mostly use allowed arguments (so that some get through), with refused ones,
    odd forms and stray values mixed in."""
    schema = load_schema()
    allowed = sorted(policy.allowed_dests(schema.dests))
    pool = [o for o in schema.options if o.dest in allowed]
    hostile = st.one_of(
        _token_group(pool),
        _token_group(list(schema.options)),
        st.sampled_from(VALUES).map(lambda v: [v]),
    )
    groups = draw(st.lists(_token_group(pool), max_size=4) | st.lists(hostile, max_size=5))
    return [t for g in groups for t in g]


# ---- the model of vLLM's parser -------------------------------------------------------------
class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # type: ignore[override]
        raise _Refused(message)


@functools.cache
def _model_parser() -> _Parser:
    p = _Parser(add_help=False, exit_on_error=False)
    for o in load_schema().options:
        if o.kind == "flag":
            p.add_argument(*o.flags, dest=o.dest, action="store_true", default=None)
        elif o.kind == "bool_optional":
            p.add_argument(
                *o.flags, dest=o.dest, action=argparse.BooleanOptionalAction, default=None
            )
        else:
            p.add_argument(
                *o.flags, dest=o.dest, nargs=o.nargs, default=None, choices=o.choices
            )
    return p


def _json_or_str(v: str) -> Any:
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def vllm_like_preprocess(args: list[str]) -> list[str]:
    out: list[str] = []
    dicts: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):  # underscores to dashes in the name, up to the first "."
            name, dot, rest = a.partition(".")
            if "=" in name:
                name, _, tail = a.partition("=")
                a = name.replace("_", "-") + "=" + tail
            else:
                a = name.replace("_", "-") + dot + rest
        key = a.partition("=")[0]
        if a.startswith("-") and "." in key:
            if "=" in a:
                value = a.partition("=")[2]
            else:
                if i + 1 >= len(args):
                    raise _Refused(f"{a} without a value")
                value = args[i + 1]
                i += 1
            base, *keys = key.split(".")
            v: Any = _json_or_str(value)
            if keys[-1].endswith("+"):
                keys[-1] = keys[-1][:-1]
                v = value.split(",")
            cur = dicts.setdefault(base, {})
            for k in keys[:-1]:
                nxt = cur.get(k)
                cur = cur.setdefault(k, {}) if isinstance(nxt, dict) or nxt is None else {}
            cur[keys[-1]] = v
            i += 1
            continue
        out.append(a)
        i += 1
    for base, d in dicts.items():
        out += [base, json.dumps(d)]
    return out


def model_parse(args: list[str]) -> dict[str, Any] | None:
    """{dest: value} the modelled vLLM parser sets from ``args``; None when it refuses them."""
    try:
        ns = _model_parser().parse_args(vllm_like_preprocess(args))
    except (_Refused, argparse.ArgumentError):
        return None
    return {k: v for k, v in vars(ns).items() if v is not None}


def json_keys(value: Any) -> set[str]:
    """Top-level keys of a JSON-config value as the parser holds it (a JSON string)."""
    if isinstance(value, list):
        value = value[-1]
    obj = _json_or_str(value) if isinstance(value, str) else value
    return set(obj) if isinstance(obj, dict) else set()


def rule_keys(dest: str) -> set[str] | None:
    rule = TENANT.get(dest)
    return set(rule.keys) if rule is not None and rule.keys is not None else None
