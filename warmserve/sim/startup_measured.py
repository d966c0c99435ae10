"""A start-up profile from the engine benchmark's measured Figure 8 starts (``measured-cpu``).

``bench/engine_bench.py --figure8`` times four starts of one real model on real vLLM, each its
own start, medians over rounds (``summary.<model>.figure8``):

* ``no_prewarm``: a fresh process (``import vllm``, engine build with stock vLLM's loader, first
  token);
* ``process_pool``: a pooled worker with vLLM imported, nothing resident: engine built and
  weights loaded at activation;
* ``engine``: the engine prepared at prewarm, one layer resident (the agent API's least; 0 means
  all): the rest of the weights loaded at activation;
* ``weights``: the full prewarm hit.

The weight path comes from the partial prewarm hits (``engine`` and the bench's hits below
all layers), round by round: each start's ``weights_resident`` stage (Activate until every layer
is in its slot; the engine was prepared, so nothing else runs beside the load) against the
bytes it loaded at Activate; a least-squares line through those points has slope
1 / ``load.bw`` and intercept ``load.setup_s``.  Not from the prewarms' own times: a prewarm call
also creates and maps its slot and shares the CPU with the engine prepared beside it (1.5 s on
2 cores), so a line through them took longer for all weights than the whole measured pooled
cold start, engine build included.  Not from the
partial starts' first tokens either: those also carry what the request waits for beside the
weights.  The stages are then the differences of the starts under that weight path
(:func:`engine_bench_profile`).  Every constant's source names the file, its command and the
fields it came from.  Measured on CPU: a model of the start-up of *this*
machine's engine, not of a GPU.
"""

from __future__ import annotations

from typing import Any

from warmserve.sim.hardware import ProfileError, StartupStages, _number
from warmserve.sim.startup import StartupProfile

_STARTS = ("no_prewarm", "process_pool", "engine", "weights")
_PROVENANCE = ("date", "machine", "command", "vllm_version", "cpu_count")


def _get(data: Any, origin: str, *keys: str) -> Any:
    cur = data
    for i, k in enumerate(keys):
        if not isinstance(cur, dict) or k not in cur:
            raise ProfileError(f"{origin}: missing field {'.'.join(keys[: i + 1])}")
        cur = cur[k]
    return cur


def _pos(data: Any, origin: str, *keys: str, strict: bool = True) -> float:
    x = _number(f"{origin}: {'.'.join(keys)}", _get(data, origin, *keys))
    if x < 0 or (strict and x == 0):
        raise ProfileError(
            f"{origin}: {'.'.join(keys)}: must be {'> 0' if strict else '>= 0'}, got {x!r}"
        )
    return x


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; (a, b)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def _weight_points(
    row: dict[str, Any], origin: str, model: str, layers: int, wbytes: float
) -> tuple[list[tuple[float, float]], list[str]]:
    """(bytes loaded at Activate, seconds until all layers were resident) of every round of a
    partial prewarm hit whose engine was prepared (module docstring), and which starts they are."""
    starts: list[tuple[str, Any]] = [("figure8.engine", (row.get("figure8") or {}).get("engine"))]
    starts += [(f"hits.{f}", rounds) for f, rounds in sorted((row.get("hits") or {}).items())]
    points: list[tuple[float, float]] = []
    used: list[str] = []
    for label, rounds in starts:
        if not isinstance(rounds, list):
            continue
        n = 0
        for i, r in enumerate(rounds):
            at = f"{origin}: models[{model}].{label}[{i}]"
            res = _pos(r, at, "layers_resident", strict=False)
            if not (0 < res < layers and r.get("engine_prepared")):
                continue
            y = _pos(r, at, "stages", "weights_resident")
            points.append(((layers - res) / layers * wbytes, y))
            n += 1
        if n:
            used.append(f"{label} x{n} ({layers - res:g} layers loaded)")
    return points, used


def engine_bench_profile(data: dict[str, Any], origin: str, name: str) -> StartupProfile:
    """The profile of a real (non-smoke) engine-bench result with Figure 8 starts."""
    prov = {k: str(_get(data, origin, k)) for k in _PROVENANCE}
    summary = _get(data, origin, "summary")
    if not isinstance(summary, dict):
        raise ProfileError(f"{origin}: summary: expected a mapping of model -> summary")
    with_stages = sorted(m for m, s in summary.items() if isinstance(s, dict) and "figure8" in s)
    if len(with_stages) != 1:
        raise ProfileError(
            f"{origin}: summary.<model>.figure8: expected exactly one model with Figure 8 "
            f"starts, found {with_stages}"
        )
    (model,) = with_stages
    s = summary[model]
    rows = [
        m for m in _get(data, origin, "models") if isinstance(m, dict) and m.get("model") == model
    ]
    if len(rows) != 1:
        raise ProfileError(f"{origin}: models: expected one entry for {model!r}")
    wbytes = _pos(rows[0], origin, "weight_bytes")
    layers = int(_pos(rows[0], origin, "layers"))
    f8 = ("summary", model, "figure8")
    t = {k: _pos(data, origin, *f8, k, "ttft_p50_s") for k in _STARTS}
    import_s = _pos(data, origin, *f8, "no_prewarm", "import_p50_s")
    points, used = _weight_points(rows[0], origin, model, layers, wbytes)
    if len({x for x, _ in points}) < 2:
        raise ProfileError(
            f"{origin}: models[{model}]: need partial prewarm hits (engine prepared, 0 < layers "
            "resident < all) of at least two sizes to fit the weight path"
        )
    a, b = _fit(points)
    if b <= 0:
        raise ProfileError(
            f"{origin}: models[{model}]: the partial hits' weights stage "
            f"{[round(y, 3) for _, y in points]} does not grow with the bytes loaded: no "
            "weight-path bandwidth can be fitted"
        )
    bw = 1.0 / b
    setup = max(0.0, a)
    load_full = setup + wbytes / bw
    engine_init = max(0.0, t["process_pool"] - t["weights"] - load_full)
    stock_load = t["no_prewarm"] - import_s - engine_init - t["weights"]
    slowdown = max(1.0, stock_load / load_full)

    cite = (
        f"{origin} ({prov['command']}; {prov['date']}, {prov['machine']}, "
        f"vLLM {prov['vllm_version']} on {prov['cpu_count']} CPUs)"
    )
    fig = f"summary.{model}.figure8"
    fit_how = (
        f"least-squares line of the weights_resident stage (Activate to all layers in the slot, "
        f"engine prepared) against the bytes loaded at Activate ({wbytes:.0f} B x layers not "
        f"resident / {layers}) over {len(points)} partial hits ({', '.join(used)}): slope "
        f"{b:.4g} s/B, intercept {a:.3f} s"
    )
    sources = {
        "stages.process_start_s": (
            f"0: included in import_s ({cite}: the fresh process is timed from before its spawn)"
        ),
        "stages.import_s": (
            f"{cite}: {fig}.no_prewarm.import_p50_s (interpreter start + import vllm, a fresh "
            "process)"
        ),
        "stages.device_init_s": f"0: the CPU engine has no device context to create ({cite})",
        "stages.engine_init_s": (
            f"{cite}: {fig}.process_pool.ttft_p50_s {t['process_pool']:.3f} s (pooled worker, "
            f"engine built and weights loaded at activation) minus the full hit "
            f"{t['weights']:.3f} s and the fitted load of all weights {load_full:.3f} s"
            + (" (clamped at 0)" if engine_init == 0 else "")
        ),
        "stages.comm_group_s": (
            f"0: not measured; the CPU engine runs TP 1, no communicator ({cite})"
        ),
        "stages.activation_s": (
            f"{cite}: {fig}.weights.ttft_p50_s (the full prewarm hit, engine prepared, Activate to "
            "first token, the forward included)"
        ),
        "load.bw": f"{cite}: fitted, 1 / slope of the {fit_how}",
        "load.setup_s": (
            f"{cite}: fitted, intercept of the {fit_how}"
            + (" (clamped at 0)" if setup == 0 else "")
        ),
        "load.stock_slowdown": (
            f"{cite}: {fig}.no_prewarm.ttft_p50_s {t['no_prewarm']:.3f} s (fresh process, stock "
            f"vLLM loader) minus import, engine_init and activation = {stock_load:.3f} s of "
            f"loading, over the weight path's {load_full:.3f} s"
            + (" (clamped at 1)" if slowdown == 1 else "")
        ),
    }
    overhead = 0
    full_hit = (s.get("hits") or {}).get("1.0") or {}
    if "prepared_host_bytes_p50" in full_hit:
        overhead = int(_pos(full_hit, origin, "prepared_host_bytes_p50", strict=False))
        sources["prepared_engine.overhead_bytes"] = (
            f"{cite}: summary.{model}.hits.1.0.prepared_host_bytes_p50 (the worker's growth "
            "while preparing the engine; host memory on CPU)"
        )
    stages = StartupStages(
        process_start_s=0.0,
        import_s=import_s,
        device_init_s=0.0,
        engine_init_s=engine_init,
        comm_group_s=0.0,
        activation_s=t["weights"],
    )
    return StartupProfile(
        name,
        stages,
        bw,
        setup,
        slowdown,
        f"measured on real vLLM on CPU ({model}, {origin}): a CPU model of a GPU system",
        sources,
        overhead,
    )
