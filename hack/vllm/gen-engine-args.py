"""Write warmserve/vllm_engine_args.json from vLLM's own argument parser (and its list of
built-in quantization methods).

Run with the vLLM venv's python (hack/vllm/setup.sh prints it):
    $(hack/vllm/setup.sh) hack/vllm/gen-engine-args.py [--check]
--check: exit 1 if the shipped file differs from what the installed vLLM gives (the `vllm`
test group runs this).  The schema lets the operator validate spec.engine.args without vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "warmserve/vllm_engine_args.json"


def _probe(fn: object) -> str:
    """Classify an argparse ``type`` callable by what it accepts."""

    def ok(v: str) -> object:
        try:
            return fn(v)  # type: ignore[operator]
        except Exception:
            return _REJECT

    one, frac, word, js = ok("1"), ok("1.5"), ok("abc"), ok('{"a": 1}')
    if isinstance(js, dict) and word is _REJECT:
        return "json"
    if isinstance(one, int) and not isinstance(one, bool) and frac is _REJECT and word is _REJECT:
        return "int"
    if isinstance(frac, float) and word is _REJECT:
        return "float"
    return "str"


_REJECT = object()


def schema() -> dict:
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older layout
        from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]

    parser = FlexibleArgumentParser()
    AsyncEngineArgs.add_cli_args(parser)
    options = []
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction) or not a.option_strings:
            continue
        if isinstance(a, argparse.BooleanOptionalAction):
            kind = "bool_optional"
            flags = [f for f in a.option_strings if not f.startswith("--no-")]
        elif a.nargs == 0:
            kind = "flag"
            flags = list(a.option_strings)
        else:
            kind = "str" if a.type is None else _probe(a.type)
            flags = list(a.option_strings)
        choices = None
        if a.choices is not None:
            choices = sorted(str(c) for c in a.choices)
        nargs = a.nargs if a.nargs in ("+", "*", "?") else None
        options.append(
            {
                "dest": a.dest,
                "flags": sorted(flags),
                "kind": kind,
                "choices": choices,
                "nargs": nargs,
            }
        )
    options.sort(key=lambda o: o["dest"])
    # --quantization takes any string; tenants may name only these built-in methods
    # (warmserve/engine_arg_policy.py).  No plugin is loaded here, so none adds its own.
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    return {
        "generated_by": "hack/vllm/gen-engine-args.py",
        "vllm_version": vllm.__version__,
        "options": options,
        "quantization_methods": sorted(QUANTIZATION_METHODS),
    }


def main() -> int:
    check = "--check" in sys.argv[1:]
    text = json.dumps(schema(), indent=1, sort_keys=True) + "\n"
    if check:
        if not OUT.exists() or OUT.read_text() != text:
            print(
                f"{OUT} is out of date for the installed vLLM: rerun hack/vllm/gen-engine-args.py",
                file=sys.stderr,
            )
            return 1
        print(f"{OUT}: up to date")
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
