"""``spec.engine.args``: vLLM's engine arguments, checked without vLLM installed.

Home of the argument schema that the operator's admission and the agent's own check share; it
imports nothing of theirs.  (The engine names are the CRD's enum: :mod:`warmserve.api.crd`.)

The operator (which does not install vLLM) must refuse an unknown or invalid argument when a
ModelDeployment is admitted, naming the argument — never at the first request.  So warmserve
ships a schema of vLLM's engine arguments (``vllm_engine_args.json``), generated from vLLM's own
parser (``EngineArgs.add_cli_args``) by ``hack/vllm/gen-engine-args.py`` for the pinned vLLM
version; the ``vllm`` test group regenerates it against the real vLLM and fails on any drift, and
checks that what this module accepts/refuses matches vLLM's parser on a set of cases.

Both engines take the same argument language (vLLM's CLI flags): the ``vllm`` engine hands them
to vLLM's parser unchanged; the ``simulated`` engine honours ``--max-num-seqs`` and
``--max-model-len`` and accepts the rest without effect.

Forms accepted (as vLLM's ``FlexibleArgumentParser``): ``--flag value``, ``--flag=value``,
underscores for dashes (``--max_model_len``), boolean flags without a value, ``--no-<flag>`` for
boolean-optional flags, and ``--<json-arg>.<key> value`` for JSON config arguments.  A value may
not start with ``-`` (but for a negative integer): vLLM's parser would read it as an option.

Who may set what is :mod:`warmserve.engine_arg_policy`: tenants get an allowlist of dests, the
admin widens it; arguments warmserve sets itself (the model, the weights' loader, parallelism,
memory sizing, device) are refused with the reason (:data:`MANAGED`) under any policy.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

from warmserve.engine_arg_policy import DEFAULT_POLICY, MANAGED, EngineArgPolicy, KeyKind, Rule

__all__ = [
    "DEFAULT_POLICY",
    "MANAGED",
    "EngineArgPolicy",
    "EngineArgsError",
    "load_schema",
    "parse_engine_args",
    "validate_engine_args",
]

SCHEMA_FILE = "vllm_engine_args.json"


class EngineArgsError(ValueError):
    """An engine argument that cannot be used; ``arg`` names it."""

    def __init__(self, arg: str, message: str) -> None:
        super().__init__(f"spec.engine.args: {arg}: {message}")
        self.arg = arg


@dataclass(frozen=True)
class Option:
    dest: str
    flags: tuple[str, ...]
    kind: str  # flag | bool_optional | int | float | str | json | any
    choices: tuple[str, ...] | None = None
    nargs: str | None = None  # None | "+" | "*" | "?"

    @property
    def takes_value(self) -> bool:
        return self.kind not in ("flag", "bool_optional")


@dataclass(frozen=True)
class Schema:
    vllm_version: str
    options: tuple[Option, ...]
    quantization_methods: tuple[str, ...] = ()  # vLLM's built-in methods

    @functools.cached_property
    def by_flag(self) -> dict[str, Option]:
        out: dict[str, Option] = {}
        for o in self.options:
            for f in o.flags:
                out[f] = o
                if o.kind == "bool_optional" and f.startswith("--"):
                    out["--no-" + f[2:]] = o
        return out

    @functools.cached_property
    def dests(self) -> frozenset[str]:
        return frozenset(o.dest for o in self.options)


@functools.cache
def load_schema() -> Schema:
    raw = json.loads(resources.files(__package__).joinpath(SCHEMA_FILE).read_text())
    return Schema(
        raw["vllm_version"],
        tuple(
            Option(
                o["dest"],
                tuple(o["flags"]),
                o["kind"],
                tuple(o["choices"]) if o.get("choices") is not None else None,
                o.get("nargs"),
            )
            for o in raw["options"]
        ),
        tuple(raw.get("quantization_methods") or ()),
    )


_INT_RE = re.compile(r"^[+-]?\d+$")
# vLLM's human_readable_int: 1k, 25.6k, 2M, 1Ki (binary), ...
_HUMAN_INT_RE = re.compile(r"^\d+(?:\.\d+)?[kKmMgGtT]i?$")
# What argparse takes as a value although it starts with "-" (vLLM has no such option).  Not
# decimals: vLLM's parser reads any "-" token with a "." in it as a --json-arg.key option.
_NEGATIVE_INT_RE = re.compile(r"^-\d+$")


def _option_like(tok: str) -> bool:
    return tok.startswith("-") and not _NEGATIVE_INT_RE.match(tok)


def _convert(opt: Option, flag: str, value: str) -> Any:
    if _option_like(value):
        raise EngineArgsError(
            flag, f"value {value!r} starts with '-' (vLLM would read it as an option)"
        )
    if opt.choices is not None and value not in opt.choices:
        raise EngineArgsError(
            flag, f"invalid choice {value!r} (choose from {', '.join(opt.choices)})"
        )
    if opt.kind == "int":
        if _INT_RE.match(value):
            return int(value)
        if _HUMAN_INT_RE.match(value):
            return value  # vLLM's parser expands it
        raise EngineArgsError(flag, f"expects an integer, got {value!r}")
    if opt.kind == "float":
        try:
            return float(value)
        except ValueError:
            raise EngineArgsError(flag, f"expects a number, got {value!r}") from None
    if opt.kind == "json":
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise EngineArgsError(flag, f"expects JSON, got {value!r} ({exc.msg})") from None
    return value


def _lookup(flag: str, schema: Schema) -> tuple[Option | None, str]:
    """(option, normalised flag); ``--max_model_len`` -> ``--max-model-len``."""
    norm = "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag
    opt = schema.by_flag.get(norm) or schema.by_flag.get(flag)
    return opt, norm


# ---- the tenant rules on values --------------------------------------------------------------
def _dotted_value(value: str) -> Any:
    """A ``--json-arg.key value`` value as vLLM's parser reads it: JSON, else the string."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _kind_ok(kind: KeyKind, value: Any) -> bool:
    if isinstance(kind, frozenset):
        return isinstance(value, str) and value in kind
    if kind == "int":
        if isinstance(value, str):
            return bool(_INT_RE.match(value) or _HUMAN_INT_RE.match(value))
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        )
    if kind == "int_list":
        return isinstance(value, list) and all(_kind_ok("int", v) for v in value)
    return False


def _describe(kind: KeyKind) -> str:
    if isinstance(kind, frozenset):
        return "one of " + ", ".join(sorted(kind))
    return {"int": "an integer", "number": "a number", "int_list": "a list of integers"}[kind]


def _check_key(flag: str, rule: Rule, key: str, value: Any) -> None:
    keys = rule.keys or {}
    if key not in keys:
        raise EngineArgsError(
            flag,
            f"key {key!r} is not allowed for tenants (allowed keys: {', '.join(sorted(keys))}); "
            "other keys can name code or paths",
        )
    if not _kind_ok(keys[key], value):
        raise EngineArgsError(flag, f"{key} must be {_describe(keys[key])}, got {value!r}")


def _check_rule(flag: str, rule: Rule, value: Any, schema: Schema) -> None:
    """A whole value (``--flag value``) against a tenant :class:`Rule`."""
    allowed = rule.values
    if rule.schema_values:
        allowed = frozenset(getattr(schema, rule.schema_values))
    if allowed is not None:
        if not isinstance(value, str) or value not in allowed:
            raise EngineArgsError(
                flag,
                f"{value!r} is not allowed for tenants (allowed: {', '.join(sorted(allowed))})",
            )
        return
    if rule.keys is not None:
        obj = value
        if isinstance(value, str):
            try:
                obj = json.loads(value)
            except json.JSONDecodeError as exc:
                raise EngineArgsError(flag, f"expects a JSON object ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise EngineArgsError(flag, f"expects a JSON object, got {value!r}")
        for k, v in obj.items():
            _check_key(flag, rule, k, v)


# ---- parsing ---------------------------------------------------------------------------------
def parse_engine_args(
    args: list[str] | tuple[str, ...],
    schema: Schema | None = None,
    policy: EngineArgPolicy | None = DEFAULT_POLICY,
) -> dict[str, Any]:
    """Validate ``args`` against vLLM's schema and ``policy`` (None: the schema and
    :data:`MANAGED` only, for code that runs after the policy was applied); return
    ``{dest: value}`` (typed best-effort).

    Raises :class:`EngineArgsError` naming the first bad argument."""
    schema = schema or load_schema()
    out: dict[str, Any] = {}
    i = 0
    args = list(args)
    while i < len(args):
        tok = args[i]
        if not isinstance(tok, str) or not _option_like(tok) or tok in ("-", "--"):
            raise EngineArgsError(
                str(tok), "expected an option such as --max-model-len (values follow their option)"
            )
        flag, eq, inline = tok.partition("=")
        key_suffix = ""
        opt, norm = _lookup(flag, schema)
        if opt is None and "." in flag:  # --compilation-config.mode 0
            base, _, key_suffix = flag.partition(".")
            opt, norm = _lookup(base, schema)
            if opt is not None and (opt.kind not in ("json", "str") or opt.choices is not None):
                opt = None
        if opt is None:
            raise EngineArgsError(
                flag,
                f"unknown vLLM engine argument (vLLM {schema.vllm_version}); "
                "see `vllm serve --help`",
            )
        if opt.dest in MANAGED:
            raise EngineArgsError(flag, f"set by warmserve: {MANAGED[opt.dest]}")
        rule: Rule | None = None
        if policy is not None:
            allowed, rule, why = policy.rule(opt.dest)
            if not allowed:
                raise EngineArgsError(flag, why)
        if not opt.takes_value and not key_suffix:
            if eq:  # vLLM's parser refuses --enforce-eager=true too
                use = f"{norm} alone"
                if opt.kind == "bool_optional" and norm.startswith("--"):
                    base = norm[2:].removeprefix("no-")
                    use = f"--{base} or --no-{base}"
                raise EngineArgsError(flag, f"is a switch and takes no value (use {use})")
            out[opt.dest] = not norm.startswith("--no-")
            i += 1
            continue
        if eq:
            values = [inline]
            i += 1
        else:
            values = []
            i += 1
            while i < len(args) and not _option_like(args[i]):
                values.append(args[i])
                i += 1
                if opt.nargs not in ("+", "*"):
                    break
            if not values and opt.nargs not in ("*", "?"):
                raise EngineArgsError(flag, "expects a value")
        if key_suffix:
            if rule is not None and rule.keys is None:
                raise EngineArgsError(flag, f"{norm} takes no JSON keys")
            cur = out.setdefault(opt.dest, {})
            if not isinstance(cur, dict):
                raise EngineArgsError(flag, f"{norm} was already given as a whole")
            value: Any = _dotted_value(values[0])
            key = key_suffix
            if key.endswith("+"):  # --json-arg.key+ a,b: vLLM appends the items to a list
                key, value = key[:-1], values[0].split(",")
            if rule is not None:
                _check_key(flag, rule, key, value)
            cur[key_suffix] = value
            continue
        conv = [_convert(opt, flag, v) for v in values]
        if rule is not None:
            for v in conv:
                _check_rule(flag, rule, v, schema)
        out[opt.dest] = conv if opt.nargs in ("+", "*") else (conv[0] if conv else None)
    return out


def validate_engine_args(
    args: list[str] | tuple[str, ...], policy: EngineArgPolicy = DEFAULT_POLICY
) -> None:
    """Raise :class:`EngineArgsError` (naming the argument) if any argument is unusable or not
    allowed by ``policy`` (default: the tenant allowlist)."""
    parse_engine_args(args, policy=policy)
