"""The physics table of docs/simulator.md (:func:`physics_table`): the paper's three models on
a GPU profile under a start-up profile — step times, KV capacity, load and start-up times and
WarmServe Figure 8's stage-by-stage first-token times.

    python -m warmserve.sim.physics_table [gpu profile] [start-up profile]
"""

from __future__ import annotations

import sys

from warmserve.sim.hardware import GpuProfile
from warmserve.sim.model_arch import ModelArch
from warmserve.sim.perf import EngineModel

PAPER_TABLE1_GIB = {"7b": 12.55, "13b": 24.24, "70b": 128.49}  # WarmServe Table 1 sizes


def physics_table(
    profile: GpuProfile,
    prompt_tokens: int = 1155,
    output_tokens: int = 211,
    load_setup_s: float = 0.0,
) -> list[dict[str, float | str]]:
    """Headline numbers of the paper's three models (TP 1/2/4, Table 1 sizes) on ``profile``:
    step times, KV capacity, load and start-up times, and the §7.2 Figure 8 stage-by-stage
    first-token times; ``load_setup_s`` is the start-up profile's fixed cost of a load from
    scratch.  The module's command (its docstring) prints it as the table in
    docs/simulator.md."""
    rows: list[dict[str, float | str]] = []
    ctx = 32 * (prompt_tokens + output_tokens // 2)
    for size, tp in (("7b", 1), ("13b", 2), ("70b", 4)):
        arch = ModelArch.llama2(size).with_weight_bytes(int(PAPER_TABLE1_GIB[size] * 2**30))
        e = EngineModel(profile, arch, tp)
        full = e.arch.num_layers
        f = load_setup_s
        stages = [
            e.ttft_s(prompt_tokens) + f,
            e.ttft_s(prompt_tokens, pooled_process=True) + f,
            e.ttft_s(prompt_tokens, pooled_process=True, engine_ready=True) + f,
            e.ttft_s(prompt_tokens, resident_layers=full, pooled_process=True, engine_ready=True),
            e.ttft_s(
                prompt_tokens,
                resident_layers=full,
                pooled_process=True,
                engine_ready=True,
                comm_group_ready=True,
            ),
        ]
        rows.append(
            {
                "model": f"llama2-{size} (TP{tp})",
                "decode_b1_ms": e.decode_step_s(1, prompt_tokens) * 1e3,
                "decode_b32_ms": e.decode_step_s(32, ctx) * 1e3,
                "prefill_ms": e.prefill_s(prompt_tokens) * 1e3,
                "kv_tokens": e.kv_capacity_tokens(),
                "load_s": e.load_s() + f,
                "cold_start_s": e.cold_start_s() + f,
                "ttft_no_prewarm_s": stages[0],
                "ttft_device_s": stages[1],
                "ttft_engine_s": stages[2],
                "ttft_weights_s": stages[3],
                "ttft_commgroup_s": stages[4],
                "device_x": stages[0] / stages[1],
                "engine_x": stages[1] / stages[2],
                "weights_comm_x": stages[2] / stages[4],
                "total_reduction": stages[0] / stages[4],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print :func:`physics_table` as a markdown table."""
    from warmserve.sim.hardware import load_profile
    from warmserve.sim.startup import load_startup

    args = sys.argv[1:] if argv is None else argv
    gpu = load_profile(args[0] if args else "h800")
    sp = load_startup(args[1] if len(args) > 1 else "fast-path", gpu)
    table = physics_table(sp.apply(gpu), load_setup_s=sp.load_setup_s)
    print("| " + " | ".join(table[0]) + " |")
    print("|" + "---|" * len(table[0]))
    for row in table:
        cells = [
            f"{v:,.3f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)
            for v in row.values()
        ]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":  # pragma: no cover - a documentation helper
    sys.exit(main())
