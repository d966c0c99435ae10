#!/usr/bin/env python
"""GPU-side measurements of the CUDA data path, in one run (``hack/gpu-check.sh`` calls this).

On GPU 0, in this order (each phase frees what it took before the next starts):

1. **VMM** (``CudaBackend`` in this process): page-pool creation, map + set access and unmap of
   one 2 MiB page (medians), a batched 1 GiB map, and the **slot switch** on an activation's
   critical path — unmap a 70 GB-equivalent slot and map as many pages into another slot (what
   evicting a prewarmed model and mapping the KV cache costs).
2. **Load bandwidth**: the same bytes (default 8 GiB of safetensors, in the page cache) copied
   (a) with one plain pinned ``cuMemcpyHtoD`` and (b) through the real worker path — a GPU worker
   process owning the memory, reading the file ranges into its pinned ring and copying on its
   non-blocking stream (``NodeCore.prewarm``).  Ratio b/a; goal >= 0.9.
3. **Llama activation**: a random-weight Llama (8B-class when memory allows) saved as
   safetensors; a **fresh process** loads it with ``from_pretrained`` and produces the first
   token; a **pooled** process (torch imported, CUDA initialised, a warm-up forward done) holds it
   prewarmed in a VMM slot and activates it: map the KV pages, build the model skeleton on the
   meta device, bind every parameter to the slot (no copy), first token.  Ratio fresh/hit (goal
   >= 30x, hit <= 0.5 s for 8B) and whether the logits are bit-identical.

Writes a JSON file and prints one table.  ``--dry-run`` runs phases 1-2 against the fake driver
(``warmserve_agent.fake_cuda``) and phase 3 on the CPU if torch is installed, with tiny sizes:
it checks that the code runs, prints **no GPU figure** and saves nothing unless ``--out`` is
given; ``--smoke`` is the same with its JSON in a temp dir (every bench has it).  (Over 400
lines: the GPU machine gets one script with its three phases, their children and the table.)

    python bench/gpu_bench.py --out bench/results/gpu-<name>.json [--budget-s 420]
    python bench/gpu_bench.py --dry-run        # --smoke: the same, JSON to a temp dir
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB, GiB = 2**20, 2**30
P = 2 * MiB
LLAMAS: dict[str, dict[str, Any]] = {
    "8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    "14b": dict(  # ~28 GB in bf16: for cards with the memory and a longer budget
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=1000000.0,
    ),
    "1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    "tiny": dict(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    ),
}
PROMPT = [1, 791, 6435, 315, 9282, 374, 279, 1176, 4037]


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---- phase 1: VMM -----------------------------------------------------------------------------
def phase_vmm(drv: Any, reserve: int, switch_bytes: int, pool_limit: int) -> dict[str, Any]:
    from warmserve_agent.backends.cuda import CudaBackend
    from warmserve_agent.memory import MemoryManager

    b = CudaBackend(driver=drv, page_bytes=P, reserve_bytes=reserve)
    mm = MemoryManager(b)
    t = time.perf_counter()
    mm.add_gpus({0: pool_limit})
    out: dict[str, Any] = {"pool_create_s": time.perf_counter() - t, **b.pool_info(0)}
    try:
        mm.create_slot("lat", [0])
        maps, unmaps = [], []
        for _ in range(200):
            t = time.perf_counter()
            mm.map_range("lat", 0, 1)
            maps.append(time.perf_counter() - t)
            t = time.perf_counter()
            mm.unmap_range("lat", 0, 1)
            unmaps.append(time.perf_counter() - t)
        out["map_page_us"] = 1e6 * med(maps)
        out["unmap_page_us"] = 1e6 * med(unmaps)
        n = min(512, mm.num_pages(0))
        t = time.perf_counter()
        mm.map_range("lat", 0, n)
        out["map_batch_pages"] = n
        out["map_batch_s"] = time.perf_counter() - t
        t = time.perf_counter()
        mm.unmap_range("lat", 0, n)
        out["unmap_batch_s"] = time.perf_counter() - t
        mm.destroy_slot("lat")
        # The switch: slot A holds S pages; evict it and map S pages into slot B.
        s = min(mm.num_pages(0), switch_bytes // P)
        out["switch_pages"], out["switch_bytes"] = s, s * P
        mm.create_slot("A", [0])
        mm.create_slot("B", [0])
        mm.map_range("A", 0, s)
        unm, mp, sw = [], [], []
        src, dst = "A", "B"
        for _ in range(3):
            t0 = time.perf_counter()
            mm.unmap_range(src, 0, s)
            t1 = time.perf_counter()
            mm.map_range(dst, 0, s)
            t2 = time.perf_counter()
            unm.append(t1 - t0)
            mp.append(t2 - t1)
            sw.append(t2 - t0)
            src, dst = dst, src
        out["switch_unmap_s"], out["switch_map_s"], out["switch_s"] = med(unm), med(mp), med(sw)
        out["switch_s_all"] = sw
    finally:
        mm.close()
    return out


# ---- phase 2: load bandwidth ------------------------------------------------------------------
def write_blob_model(root: Path, name: str, nbytes: int, tensor_bytes: int = 256 * MiB) -> int:
    """A safetensors "model" of uint8 tensors (one per layer) of pseudo-random bytes."""
    import numpy as np

    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    layers = max(1, nbytes // tensor_bytes)
    tensor_bytes = nbytes // layers
    header = {
        f"model.layers.{i}.w": {
            "dtype": "U8",
            "shape": [tensor_bytes],
            "data_offsets": [i * tensor_bytes, (i + 1) * tensor_bytes],
        }
        for i in range(layers)
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    block = np.random.default_rng(1).integers(0, 256, min(64 * MiB, tensor_bytes), np.uint8)
    with open(d / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        left = layers * tensor_bytes
        while left:
            k = min(left, block.nbytes)
            f.write(block[:k].tobytes())
            left -= k
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
    return layers * tensor_bytes


def plain_pinned_copy(drv: Any, path: Path, reps: int = 3) -> dict[str, Any]:
    """The reference: the file's bytes in one pinned buffer, one cuMemcpyHtoD to cuMemAlloc'd
    device memory (a plain pinned cudaMemcpy), timed after the copy returns."""
    import ctypes

    def call(name: str, *a: Any) -> Any:
        r = getattr(drv, name)(*a)
        if r[0] != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{name}: {r[0]}")
        return r[1] if len(r) > 1 else None

    size = path.stat().st_size
    call("cuInit", 0)
    dev = call("cuDeviceGet", 0)
    ctx = call("cuDevicePrimaryCtxRetain", dev)
    call("cuCtxSetCurrent", ctx)
    host = call("cuMemHostAlloc", size, 0)
    dptr = None
    try:
        view = memoryview((ctypes.c_ubyte * size).from_address(int(host))).cast("B")
        with open(path, "rb") as f:
            f.readinto(view)
        view.release()
        dptr = call("cuMemAlloc", size)
        secs = []
        for _ in range(reps):
            t = time.perf_counter()
            call("cuMemcpyHtoD", dptr, int(host), size)
            secs.append(time.perf_counter() - t)
    finally:
        if dptr is not None:
            call("cuMemFree", dptr)
        call("cuMemFreeHost", host)
        call("cuDevicePrimaryCtxRelease", dev)
    return {"bytes": size, "seconds": secs, "bytes_per_s": size / med(secs)}


RINGS = {  # staging ring variants measured in phase 2 (the first is the agent's default)
    "16MiB x 8, 4 readers": {},
    "32MiB x 8, 8 readers": dict(staging_chunk_bytes=32 * MiB, staging_depth=8, staging_readers=8),
}


def worker_path_load(
    root: Path,
    name: str,
    nbytes: int,
    reserve: int,
    driver_spec: str | None,
    staging: dict[str, int],
    reps: int = 3,
) -> dict[str, Any]:
    """Prewarm the model through NodeCore into memory a GPU worker process owns."""
    from warmserve_agent.backends.workers import WorkerMemoryBackend
    from warmserve_agent.engine_host import WorkerEngine
    from warmserve_agent.memory import MemoryManager
    from warmserve_agent.node import NodeCore
    from warmserve_agent.store import WeightStore
    from warmserve_agent.worker import WorkerPool

    pool = WorkerPool([0], spares=0)
    pool.start()
    opts: dict[str, Any] = {"reserve_bytes": reserve, **staging}
    if driver_spec:
        opts["driver"] = driver_spec
    backend = WorkerMemoryBackend(pool, "cuda", P, **opts)
    core = NodeCore(
        MemoryManager(backend),
        WeightStore(root),
        {0: nbytes + 256 * MiB},
        lambda g: WorkerEngine(pool, g),
        node_name="gpu-bench",
    )
    loader_bw, wall = [], []
    try:
        for _ in range(reps):
            t = time.perf_counter()
            slot = core.prewarm(name, [0])
            slot.loader.join()
            wall.append(time.perf_counter() - t)
            if slot.state != "ready":
                raise RuntimeError(f"prewarm failed: {slot.message}")
            loader_bw.append(slot.bandwidth)
            core.evict(slot.slot_id)
    finally:
        core.shutdown()
        core.mm.close()
        pool.close()
    return {
        "bytes": nbytes,
        "wall_s": wall,
        "loader_bytes_per_s": loader_bw,
        "bytes_per_s": nbytes / med(wall),
    }


# ---- phase 3: Llama ---------------------------------------------------------------------------
def llama_weights(size: str, d: Path, device: str) -> int:
    """Random bf16 weights (norms = 1) for LLAMAS[size], saved as HF safetensors + config."""
    import torch
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**LLAMAS[size], dtype=torch.bfloat16)
    with init_empty_weights():
        skel = LlamaForCausalLM(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for name, p in skel.named_parameters():
        if name.endswith("norm.weight"):
            t = torch.ones(p.shape, dtype=torch.bfloat16, device=device)
        else:
            t = torch.empty(p.shape, dtype=torch.bfloat16, device=device)
            t.normal_(0.0, 0.02, generator=g)
        tensors[name] = t.cpu()
        del t
    d.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(d)
    return sum(t.numel() * 2 for t in tensors.values())


def fresh_child(args: argparse.Namespace) -> int:
    """Child process: import, load with from_pretrained, first token; one JSON line out."""
    t_start = time.time()
    import numpy as np
    import torch
    from transformers import LlamaForCausalLM

    t_import = time.time()
    dev = args.device
    kw: dict[str, Any] = {"dtype": torch.bfloat16}
    if dev != "cpu":
        kw["device_map"] = dev
    model = LlamaForCausalLM.from_pretrained(args.fresh_child, **kw)
    t_load = time.time()
    ids = torch.tensor([args.ids], device=dev)
    with torch.no_grad():
        logits = model(ids).logits.float()
    token = int(logits[0, -1].argmax())  # .item(): waits for the device
    t_tok = time.time()
    np.save(args.logits, logits.cpu().numpy())
    print(
        json.dumps(
            {
                "token": token,
                "t_start": t_start,
                "import_s": t_import - t_start,
                "load_s": t_load - t_import,
                "first_forward_s": t_tok - t_load,
                "t_first_token": t_tok,
                "attn": model.config._attn_implementation,
            }
        ),
        flush=True,
    )
    return 0


def run_fresh(d: Path, device: str, ids: list[int], tmp: Path) -> dict[str, Any]:
    out = tmp / "fresh-logits.npy"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--fresh-child", str(d)]
    cmd += ["--device", device, "--ids", ",".join(map(str, ids)), "--logits", str(out)]
    t_spawn = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"fresh process failed:\n{res.stderr[-3000:]}")
    info = json.loads(res.stdout.strip().splitlines()[-1])
    info["first_token_s"] = info["t_first_token"] - t_spawn  # spawn -> first token
    info["logits_file"] = str(out)
    return info


def phase_llama(
    drv: Any, size: str, device: str, tmp: Path, reserve: int, reps: int = 3
) -> dict[str, Any]:
    import numpy as np
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM
    from warmserve_agent.loader import load_layers
    from warmserve_agent.memory import pages_for
    from warmserve_agent.slot_tensors import bind_module
    from warmserve_agent.store import WeightStore

    ids = [i % LLAMAS[size]["vocab_size"] for i in PROMPT]
    out: dict[str, Any] = {"size": size, "device": device, "prompt_tokens": len(ids)}
    # The pooled process's warm state: libraries imported, CUDA up, kernels and handles warm.
    t = time.perf_counter()
    warm = LlamaForCausalLM(LlamaConfig(**LLAMAS["tiny"])).to(device, torch.bfloat16)
    with torch.no_grad():
        warm(torch.tensor([[1, 2, 3]], device=device))
    del warm
    out["pool_warmup_s"] = time.perf_counter() - t
    root = tmp / "models"
    name = f"llama-{size}"
    t = time.perf_counter()
    out["weight_bytes"] = llama_weights(size, root / name, device)
    out["write_weights_s"] = time.perf_counter() - t
    if device != "cpu":
        torch.cuda.empty_cache()
    fresh = run_fresh(root / name, device, ids, tmp)
    out["fresh"] = {k: v for k, v in fresh.items() if not k.startswith("t_")}
    ref = np.load(fresh["logits_file"])

    cfg = AutoConfig.from_pretrained(root / name)
    store = WeightStore(root)
    layout = store.layout(name, 1)
    wpages = pages_for(layout.total_bytes, P)
    mm = None
    if device == "cpu":  # dry run: the "slot" is one host buffer laid out like a slot
        buf = bytearray(layout.total_bytes)
        t = time.perf_counter()
        for p in layout.placements:
            buf[p.slot_offset : p.slot_offset + p.tensor.nbytes] = store.host_view(p.tensor)
        out["prewarm_s"] = time.perf_counter() - t

        def base_tensor() -> Any:
            return torch.frombuffer(buf, dtype=torch.uint8)

        def map_kv() -> int:
            return 0

        def unmap_kv(n: int) -> None:
            return None
    else:
        from warmserve_agent.backends.cuda import CudaBackend
        from warmserve_agent.memory import MemoryManager

        mm = MemoryManager(CudaBackend(driver=drv, page_bytes=P, reserve_bytes=reserve))
        mm.add_gpus({0: 1 << 50})
        out["pool_pages"] = mm.num_pages(0)
        mm.create_slot("llama", [0])
        t = time.perf_counter()
        load_layers(mm, store, "llama", layout, [0], 0, layout.model.num_layers)
        out["prewarm_s"] = time.perf_counter() - t  # in-process ring, pinned, async
        va = mm.va_base("llama", 0)
        slot_mm = mm

        def base_tensor() -> Any:
            return slot_mm.backend.torch_view(0, va, layout.total_bytes)

        def map_kv() -> int:
            return slot_mm.map_all_free("llama", wpages)  # activation maps the KV cache

        def unmap_kv(n: int) -> None:
            slot_mm.unmap_range("llama", wpages, n)

    hits: list[dict[str, float]] = []
    same = []
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            kv = map_kv()
            t1 = time.perf_counter()
            with init_empty_weights():
                model = LlamaForCausalLM(cfg)
            t2 = time.perf_counter()
            bind_module(model, layout, base_tensor())
            model.to(device)  # buffers only: parameters already live in the slot
            t3 = time.perf_counter()
            with torch.no_grad():
                logits = model(torch.tensor([ids], device=device)).logits.float()
            token = int(logits[0, -1].argmax())
            t4 = time.perf_counter()
            hits.append(
                {
                    "kv_map_s": t1 - t0,
                    "kv_pages": kv,
                    "skeleton_s": t2 - t1,
                    "bind_s": t3 - t2,
                    "first_forward_s": t4 - t3,
                    "first_token_s": t4 - t0,
                }
            )
            got = logits.cpu().numpy()
            same.append(bool(np.array_equal(got, ref)) and token == fresh["token"])
            out["max_abs_logit_diff"] = float(np.abs(got - ref).max())
            del model, logits
            if device != "cpu":
                torch.cuda.synchronize()
            unmap_kv(kv)
    finally:
        if mm is not None:
            mm.close()
    out["hit"] = hits
    out["hit_first_token_s"] = med([h["first_token_s"] for h in hits])
    out["fresh_over_hit"] = fresh["first_token_s"] / out["hit_first_token_s"]
    out["outputs_identical"] = all(same)
    return out


# ---- driver, environment, table ---------------------------------------------------------------
def gpu_info(drv: Any) -> dict[str, Any]:
    def call(name: str, *a: Any) -> Any:
        r = getattr(drv, name)(*a)
        return r[1] if len(r) > 1 else None

    call("cuInit", 0)
    dev = call("cuDeviceGet", 0)
    raw = call("cuDeviceGetName", 256, dev)
    name = raw.split(b"\0")[0].decode() if isinstance(raw, bytes) else str(raw)
    info = {
        "name": name,
        "total_bytes": int(call("cuDeviceTotalMem", dev)),
        "driver_version": int(call("cuDriverGetVersion")),
        "python": platform.python_version(),
    }
    for mod in ("torch", "transformers", "cuda.bindings", "grpc", "google.protobuf"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            info[mod] = getattr(m, "__version__", "?")
        except Exception as exc:  # recorded, not fatal: phase 3 reports it
            info[mod] = f"missing ({type(exc).__name__})"
    return info


def table(res: dict[str, Any]) -> str:
    rows: list[tuple[str, str, str]] = []
    v, ld, lm = res.get("vmm"), res.get("load"), res.get("llama")
    if v:
        rows += [
            (f"page pool: {v['pages']} pages of 2 MiB created", f"{v['pool_create_s']:.2f} s", ""),
            ("map 1 page + set access (median of 200)", f"{v['map_page_us']:.1f} us", ""),
            ("unmap 1 page (median of 200)", f"{v['unmap_page_us']:.1f} us", ""),
            (
                f"map {v['map_batch_pages']} pages, one set access",
                f"{v['map_batch_s'] * 1e3:.1f} ms",
                "",
            ),
            (
                f"slot switch {v['switch_bytes'] / 1e9:.1f} GB: "
                f"unmap + map {v['switch_pages']} pages",
                f"{v['switch_s']:.3f} s",
                "",
            ),
            (
                "  of which unmap / map",
                f"{v['switch_unmap_s']:.3f} / {v['switch_map_s']:.3f} s",
                "",
            ),
        ]
    if ld:
        pl, wk = ld["plain"], ld["worker"]
        gb = pl["bytes"] / 1e9
        rows += [
            (
                f"load {gb:.1f} GB: plain pinned cuMemcpyHtoD",
                f"{pl['bytes_per_s'] / 1e9:.2f} GB/s",
                "",
            ),
            (
                f"load {gb:.1f} GB: worker path (file ranges, ring)",
                f"{wk['bytes_per_s'] / 1e9:.2f} GB/s",
                "",
            ),
            ("ratio worker / plain", f"{ld['ratio']:.2f}", ">= 0.9"),
        ]
        for label, var in list(ld.get("variants", {}).items())[1:]:
            rows.append(
                (f"  worker path, ring {label}", f"{var['bytes_per_s'] / 1e9:.2f} GB/s", "")
            )
    if lm:
        gb = lm["weight_bytes"] / 1e9
        rows += [
            (
                f"Llama {lm['size']} ({gb:.1f} GB bf16): fresh process -> 1st token",
                f"{lm['fresh']['first_token_s']:.2f} s",
                "",
            ),
            (
                f"  prewarm hit -> 1st token (median of {len(lm['hit'])})",
                f"{lm['hit_first_token_s']:.3f} s",
                "<= 0.5 s (8B)",
            ),
            (
                "  of which KV map / skeleton / bind / forward",
                "/".join(
                    f"{med([h[k] for h in lm['hit']]):.3f}"
                    for k in ("kv_map_s", "skeleton_s", "bind_s", "first_forward_s")
                )
                + " s",
                "",
            ),
            ("  ratio fresh / hit", f"{lm['fresh_over_hit']:.0f}x", ">= 30x"),
            (
                "  outputs identical (logits, bitwise)",
                "yes"
                if lm["outputs_identical"]
                else f"NO (max diff {lm['max_abs_logit_diff']:.3g})",
                "yes",
            ),
        ]
    for k, why in res.get("not_run", {}).items():
        rows.append((f"{k}: not run", why[:60], ""))
    w = max(len(r[0]) for r in rows) if rows else 10
    head = f"{'measure':<{w}}  {'value':>22}  goal"
    return "\n".join([head] + [f"{a:<{w}}  {b:>22}  {c}" for a, b, c in rows])


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--out", type=Path, help="JSON result file (real runs: bench/results/gpu-<name>.json)"
    )
    ap.add_argument("--dry-run", action="store_true", help="fake driver + CPU torch, tiny sizes")
    ap.add_argument("--smoke", action="store_true",
                    help="--dry-run with its JSON in a temp dir (every bench has --smoke)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting phases after this")
    ap.add_argument("--reserve-gib", type=float, default=4.0, help="pool reserve (--gpu-reserve)")
    ap.add_argument("--switch-gb", type=float, default=70.0)
    ap.add_argument("--load-gib", type=float, default=8.0)
    ap.add_argument("--llama", choices=["auto", "14b", "8b", "1b", "tiny", "none"], default="auto")
    ap.add_argument("--phases", default="vmm,load,llama")
    ap.add_argument("--fresh-child", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda:0", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--logits", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.smoke:
        args.dry_run = True
        args.out = args.out or Path(tempfile.mkdtemp(prefix="gpu-bench-smoke-")) / "gpu.json"
    if args.fresh_child:
        args.ids = [int(x) for x in args.ids.split(",")]
        return fresh_child(args)

    budget = Budget(args.budget_s)
    phases = set(args.phases.split(","))
    reserve = int(args.reserve_gib * GiB)
    driver_spec = None
    if args.dry_run:
        os.environ.setdefault("WARMSERVE_FAKE_CUDA_DEVICES", "1")
        os.environ.setdefault("WARMSERVE_FAKE_CUDA_MEM", str(2 * GiB))
        from warmserve_agent.fake_cuda import DRIVER as drv

        driver_spec = "warmserve_agent.fake_cuda:DRIVER"
        reserve, switch, load_bytes = 64 * MiB, 256 * MiB, 64 * MiB
    else:
        from warmserve_agent.backends.cuda_driver import import_driver

        drv = import_driver()
        switch, load_bytes = int(args.switch_gb * 1e9), int(args.load_gib * GiB)
    res: dict[str, Any] = {
        "dry_run": args.dry_run,
        "gpu": gpu_info(drv),
        "time_unix": time.time(),
        "command": " ".join(sys.argv),
        "not_run": {},
    }

    def save() -> None:  # after every phase: a run cut off by its time limit keeps its numbers
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(res, indent=2, default=str))

    label = (
        "DRY RUN: fake driver, no GPU: no figure below is a GPU measurement"
        if args.dry_run
        else res["gpu"]["name"]
    )
    print(f"== warmserve GPU bench: {label}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as td:
        tmp = Path(td)

        def run(phase: str, fn: Any) -> None:  # a failing phase is recorded; the rest run
            try:
                res[phase] = fn()
            except Exception as exc:
                import traceback

                res["not_run"][phase] = f"FAILED: {type(exc).__name__}: {exc}"
                res.setdefault("errors", {})[phase] = traceback.format_exc()[-4000:]
                print(res["errors"][phase], file=sys.stderr, flush=True)
            save()

        if "vmm" in phases:
            print("== phase 1: VMM", flush=True)
            limit = 1 << 50 if not args.dry_run else 512 * MiB
            run("vmm", lambda: phase_vmm(drv, reserve, switch, limit))
        if "load" in phases:
            if budget.left() < 90:
                res["not_run"]["load"] = f"{budget.left():.0f} s of budget left"
            else:
                print("== phase 2: load bandwidth", flush=True)

                def load() -> dict[str, Any]:
                    tb = 256 * MiB if not args.dry_run else 8 * MiB
                    n = write_blob_model(tmp / "models", "bw", load_bytes, tb)
                    plain = plain_pinned_copy(drv, tmp / "models" / "bw" / "model.safetensors")
                    variants = {}
                    for label, staging in RINGS.items():
                        if variants and budget.left() < 150:
                            break
                        variants[label] = worker_path_load(
                            tmp / "models", "bw", n, reserve, driver_spec, staging
                        )
                    worker = next(iter(variants.values()))
                    return {
                        "plain": plain,
                        "worker": worker,
                        "variants": variants,
                        "ratio": worker["bytes_per_s"] / plain["bytes_per_s"],
                    }

                run("load", load)
        if "llama" in phases:
            size = args.llama
            try:
                import torch  # noqa: F401
                import transformers  # noqa: F401
            except ImportError as exc:
                res["not_run"]["llama"] = f"needs torch + transformers ({exc})"
                size = "none"
            device = "cpu" if args.dry_run else "cuda:0"
            if size == "auto":
                free = res["gpu"]["total_bytes"]
                size = "tiny" if args.dry_run else ("8b" if free >= 40 * GiB else "1b")
            if size != "none":
                need = {"14b": 400, "8b": 240, "1b": 120, "tiny": 30}[size]
                if budget.left() < need:
                    res["not_run"]["llama"] = (
                        f"{budget.left():.0f} s of budget left, {size} needs ~{need} s"
                    )
                else:
                    print(f"== phase 3: Llama {size}", flush=True)
                    run("llama", lambda: phase_llama(drv, size, device, tmp, reserve))
            elif args.llama == "none":
                res["not_run"]["llama"] = "--llama none"
    text = table(res)
    print(text)
    res["table"] = text
    save()
    if args.out:
        print(f"saved {args.out}")
    return 1 if res.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
