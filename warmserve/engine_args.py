"""``spec.engine.args``: vLLM's engine arguments, checked without vLLM installed.

Home of the engine names and argument schema that the operator, the gateway (through the CRD
types) and the agent share; it imports nothing of theirs.

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
boolean-optional flags, and ``--<json-arg>.<key> value`` for JSON config arguments.

Arguments warmserve sets itself (the model, the weights' loader, parallelism, memory sizing,
device) are refused with the reason (:data:`MANAGED`).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

SCHEMA_FILE = "vllm_engine_args.json"
# Engine names of the node agent's registry (warmserve_agent.engines.ENGINES, checked equal by a
# test): here so the operator and the gateway can validate spec.engine.name without the agent.
ENGINE_NAMES = ("simulated", "vllm")

# dest -> why warmserve owns it
MANAGED: dict[str, str] = {
    "model": "the model is spec.model.name",
    "served_model_name": "instances are served under spec.model.name",
    "load_format": "weights are loaded from the prewarm slot by warmserve's loader",
    "model_loader_extra_config": "weights are loaded from the prewarm slot by warmserve's loader",
    "download_dir": "weights come from the node's weight store",
    "tensor_parallel_size": "set spec.tensorParallel instead",
    "pipeline_parallel_size": "warmserve places one instance on one node's GPU group",
    "data_parallel_size": "scale with instances (spec.minInstances/maxInstances) instead",
    "distributed_executor_backend": "the engine runs in warmserve's pooled worker process",
    "worker_cls": "the engine runs in warmserve's pooled worker process",
    "gpu_memory_utilization": "the KV cache is sized to the slot's pages by the agent",
    "kv_cache_memory_bytes": "the KV cache is sized to the slot's pages by the agent",
    "num_gpu_blocks_override": "the KV cache is sized to the slot's pages by the agent",
    "enable_sleep_mode": "the agent owns the memory (prewarm slots), not vLLM's sleep mode",
    "otlp_traces_endpoint": "traces go where the agent's --otlp-traces-endpoint says "
    "(the chart's tracing.endpoint)",
}


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

    @functools.cached_property
    def by_flag(self) -> dict[str, Option]:
        out: dict[str, Option] = {}
        for o in self.options:
            for f in o.flags:
                out[f] = o
                if o.kind == "bool_optional" and f.startswith("--"):
                    out["--no-" + f[2:]] = o
        return out


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
    )


_INT_RE = re.compile(r"^[+-]?\d+$")
# vLLM's human_readable_int: 1k, 25.6k, 2M, 1Ki (binary), ...
_HUMAN_INT_RE = re.compile(r"^\d+(?:\.\d+)?[kKmMgGtT]i?$")


def _convert(opt: Option, flag: str, value: str) -> Any:
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


def parse_engine_args(
    args: list[str] | tuple[str, ...], schema: Schema | None = None
) -> dict[str, Any]:
    """Validate ``args`` against vLLM's schema; return ``{dest: value}`` (typed best-effort).

    Raises :class:`EngineArgsError` naming the first bad argument."""
    schema = schema or load_schema()
    out: dict[str, Any] = {}
    i = 0
    args = list(args)
    while i < len(args):
        tok = args[i]
        if not isinstance(tok, str) or not tok.startswith("-") or tok in ("-", "--"):
            raise EngineArgsError(
                str(tok), "expected an option such as --max-model-len (values follow their option)"
            )
        flag, eq, inline = tok.partition("=")
        key_suffix = ""
        opt, norm = _lookup(flag, schema)
        if opt is None and "." in flag:  # --compilation-config.level 0
            base, _, key_suffix = flag.partition(".")
            opt, norm = _lookup(base, schema)
            if opt is not None and opt.kind not in ("json", "str"):
                opt = None
        if opt is None:
            raise EngineArgsError(
                flag,
                f"unknown vLLM engine argument (vLLM {schema.vllm_version}); "
                "see `vllm serve --help`",
            )
        if opt.dest in MANAGED:
            raise EngineArgsError(flag, f"set by warmserve: {MANAGED[opt.dest]}")
        if not opt.takes_value and not key_suffix:
            if eq:
                if opt.kind != "bool_optional" or inline.lower() not in ("true", "false"):
                    raise EngineArgsError(flag, "is a switch and takes no value")
                out[opt.dest] = inline.lower() == "true"
            else:
                out[opt.dest] = not norm.startswith("--no-")
            i += 1
            continue
        if eq:
            values = [inline]
            i += 1
        else:
            values = []
            i += 1
            while i < len(args) and not (args[i].startswith("--") and len(args[i]) > 2):
                values.append(args[i])
                i += 1
                if opt.nargs not in ("+", "*"):
                    break
            if not values and opt.nargs not in ("*", "?"):
                raise EngineArgsError(flag, "expects a value")
        if key_suffix:
            cur = out.setdefault(opt.dest, {})
            if not isinstance(cur, dict):
                raise EngineArgsError(flag, f"{norm} was already given as a whole")
            try:
                cur[key_suffix] = json.loads(values[0])
            except json.JSONDecodeError:
                cur[key_suffix] = values[0]
            continue
        conv = [_convert(opt, flag, v) for v in values]
        out[opt.dest] = conv if opt.nargs in ("+", "*") else (conv[0] if conv else None)
    return out


def validate_engine_args(args: list[str] | tuple[str, ...]) -> None:
    """Raise :class:`EngineArgsError` (naming the argument) if any argument is unusable."""
    parse_engine_args(args)
