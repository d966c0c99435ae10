#!/usr/bin/env python
"""Gateway benchmark: what the gateway adds in front of one engine, and a cold-start burst.

1. **Overhead** — ``--concurrency`` (64) closed-loop clients send chat completions for
   ``--seconds`` per round, alternately straight to one simulated engine and through a gateway
   replica in front of it (rounds interleaved, so both paths see the same machine noise).  Per
   path: requests/s and end-to-end latency percentiles; then the gateway's added latency
   (p50/p99 via the gateway minus direct) and its throughput as a ratio of direct.  The engine is
   the simulated one (``warmserve agent --simulate-gpus``, engine in a worker process) with a
   large batch, so the engine never queues; the gateway reads the instance from
   ``--models-file`` (the same code path as the Kubernetes watch).  Everything runs on this
   machine: load generator, gateway and engine share its cores, so absolute numbers say little
   (no GPU); the ratios are the result.  With ``--tracing`` a second gateway replica with
   OpenTelemetry tracing on (``--trace-sample-ratio``, default every request) exporting to a
   real collector (``hack/testbin/build.sh otelcol``) is a fourth path in the same rounds: what
   tracing costs the gateway, side by side with it off.
2. **Cold-start burst** — on a real kube-apiserver (hack/k8s binaries; built once if missing):
   an agent with simulated GPUs whose weight loads are paced like a ``--copy-gbps`` host-to-GPU
   link, the operator and a gateway as the chart wires them.  ``--burst`` streaming requests hit
   a model with zero instances, once with a prewarmed replica resident (a prewarm hit) and once
   without (a cold start).  Per request: time to first token measured by the client; plus the
   time from the first held request to the operator's start request (from their logs) and the
   agent's activation time.

    python bench/gateway_bench.py [--concurrency 64] [--seconds 8] [--rounds 3]
                                  [--tracing [--trace-sample-ratio 1.0]] [--stream]
                                  [--baseline-pythonpath DIR/gateway:DIR]
                                  [--burst 16] [--no-burst] [--out bench/results/gateway_bench.json]
    python bench/gateway_bench.py --smoke     # seconds: tiny sizes, --tracing, JSON to a temp dir

A child (agent, gateway, operator, proxy) or the control plane failing ends the bench at once
with its last log lines (status 1); SIGTERM/SIGINT stop everything it started.  (Over 400 lines:
one script, its two parts and their table, read top to bottom.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from warmserve_agent.testing import write_model

from warmserve.testing.k8s import ControlPlane, ensure_binaries, stop_control_plane
from warmserve.testing.otel import Collector
from warmserve.testing.procs import Procs, log_times, run_supervised
from warmserve.testing.smoke import add_smoke_flag, apply_smoke
from warmserve.testing.stack import Stack, seed_history

REPO = Path(__file__).resolve().parents[1]

MiB = 1024**2
SMOKE = {
    "concurrency": 4, "seconds": 1.0, "rounds": 1, "max_tokens": 4, "decode_tok_s": "400",
    "burst": 2, "poll": 2.0, "tracing": True,
}  # fmt: skip


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * len(xs)) - 1))] if xs else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def load_avg() -> float:
    return os.getloadavg()[0]


# ------------------------------------------------------------------------------------ overhead


async def closed_loop(url: str, body: bytes, concurrency: int, seconds: float) -> dict[str, Any]:
    import aiohttp

    lat: list[float] = []
    errors = 0
    stop_at = time.perf_counter() + seconds
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def worker() -> None:
            nonlocal errors
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                try:
                    async with s.post(
                        url, data=body, headers={"Content-Type": "application/json"}
                    ) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    lat.append(time.perf_counter() - t0)
                else:
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"n": len(lat), "errors": errors, "rps": len(lat) / wall, "lat": lat}


# The floor of any aiohttp proxy: read the body, POST it upstream over a pooled session, send the
# answer back. Measured beside the gateway so its own logic (routing, holding, metrics) can be
# told apart from the cost of the Python HTTP stack both share.
BARE_PROXY = """
import sys, aiohttp
from aiohttp import web
UP = sys.argv[2]
async def handle(request):
    body = await request.read()
    async with request.app["s"].post(
        UP + request.path_qs, data=body, headers={"Content-Type": "application/json"}
    ) as up:
        return web.Response(status=up.status, body=await up.read(), content_type="application/json")
async def session(app):
    app["s"] = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar())
    yield
    await app["s"].close()
app = web.Application()
app.router.add_post("/v1/chat/completions", handle)
app.cleanup_ctx.append(session)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
"""


def cpu_seconds(pid: int, tree: bool = False) -> float:
    """User + system CPU seconds of a process (and its descendants with ``tree``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        if tree:
            for task in Path(f"/proc/{pid}/task").iterdir():
                for child in (task / "children").read_text().split():
                    total += cpu_seconds(int(child), tree=True)
        return total
    except OSError:
        return 0.0


def bench_overhead(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """One agent (simulated GPU per engine speed), one instance per speed, one gateway."""
    from warmserve.api.agent.client import SyncAgentClient

    models = tmp / "models"
    speeds = [float(x) for x in args.decode_tok_s.split(",")]
    for k, speed in enumerate(speeds):
        profile = {"max_batch": 1024, "decode_tok_s": speed, "prefill_tok_s": 1e6}
        write_model(models, f"bench-{k}", layers=2, hidden=32, seed=k + 1, profile=profile)
    tmp.mkdir(parents=True, exist_ok=True)
    procs = Procs(tmp)
    out: dict[str, Any] = {}
    otel = None
    try:
        if args.tracing:
            otel = Collector(tmp / "otelcol").start()
            procs.also_check(otel.check)
        agent_addr = f"127.0.0.1:{free_port()}"
        agent = procs.start(
            "agent",
            [sys.executable, "-m", "warmserve", "agent", "--simulate-gpus",
             f"{len(speeds)}x64MiB", "--model-dir", str(models), "--listen", agent_addr,
             "--memory-dir", str(tmp / "mem"), "--log-level", "WARNING"],
            dict(os.environ),
        )  # fmt: skip

        def connected() -> SyncAgentClient:
            client = SyncAgentClient(agent_addr)
            try:
                client.describe()
            except Exception:
                client.close()
                raise
            return client

        client = procs.wait_for(connected, "the agent serving", 120, step=0.1)
        instances = [client.activate(f"bench-{k}", [k]).instance for k in range(len(speeds))]
        client.close()
        mds = [
            {
                "apiVersion": "warmserve.io/v1alpha1",
                "kind": "ModelDeployment",
                "metadata": {"name": f"bench-{k}", "namespace": "bench", "uid": f"u{k}"},
                "spec": {"model": {"name": f"bench-{k}"}, "maxBatchSize": 1024},
                "status": {
                    "instances": [
                        {"id": inst.instance_id, "endpoint": inst.endpoint, "phase": "serving"}
                    ]
                },
            }
            for k, inst in enumerate(instances)
        ]
        # the agent's records (what the operator mirrors into its GPUNode): the gateway routes
        # only to instances a GPUNode lists
        mds.append(
            {
                "apiVersion": "warmserve.io/v1alpha1",
                "kind": "GPUNode",
                "metadata": {"name": "bench-node"},
                "spec": {"agentAddress": agent_addr},
                "status": {
                    "instances": [
                        {"id": inst.instance_id, "model": f"bench-{k}", "endpoint": inst.endpoint}
                        for k, inst in enumerate(instances)
                    ]
                },
            }
        )
        (tmp / "models.json").write_text(json.dumps(mds))
        addr = tmp / "gw.json"
        gateway = procs.start(
            "gateway",
            [sys.executable, "-m", "warmserve", "gateway", "--models-file",
             str(tmp / "models.json"), "--host", "127.0.0.1", "--port", "0",
             "--admin-host", "127.0.0.1", "--admin-port", "0", "--address-file", str(addr),
             "--anonymous-namespace", "bench", "--log-level", "warning"],
            dict(os.environ),
        )  # fmt: skip
        urls = procs.wait_for(lambda: addr.exists() and addr.read_text(), "the gateway", 120)
        gw = json.loads(urls)["api"]
        traced: subprocess.Popen[bytes] | None = None
        if otel is not None:  # the same gateway, tracing every request to the collector
            addr2 = tmp / "gw-traced.json"
            traced = procs.start(
                "gateway-traced",
                [sys.executable, "-m", "warmserve", "gateway", "--models-file",
                 str(tmp / "models.json"), "--host", "127.0.0.1", "--port", "0",
                 "--admin-host", "127.0.0.1", "--admin-port", "0", "--address-file", str(addr2),
                 "--anonymous-namespace", "bench", "--log-level", "warning",
                 "--otlp-traces-endpoint", otel.endpoint,
                 "--trace-sample-ratio", str(args.trace_sample_ratio)],
                dict(os.environ),
            )  # fmt: skip
            traced_urls = procs.wait_for(
                lambda: addr2.exists() and addr2.read_text(), "the traced gateway", 120
            )
            gw_traced = json.loads(traced_urls)["api"]
        baseline: subprocess.Popen[bytes] | None = None
        gw_baseline = ""
        if args.baseline_pythonpath:  # the same gateway, as other code (e.g. an older commit)
            addr3 = tmp / "gw-baseline.json"
            baseline = procs.start(
                "gateway-baseline",
                [sys.executable, "-m", "warmserve", "gateway", "--models-file",
                 str(tmp / "models.json"), "--host", "127.0.0.1", "--port", "0",
                 "--admin-host", "127.0.0.1", "--admin-port", "0", "--address-file", str(addr3),
                 "--anonymous-namespace", "bench", "--log-level", "warning"],
                {**os.environ, "PYTHONPATH": args.baseline_pythonpath},
            )  # fmt: skip
            baseline_urls = procs.wait_for(
                lambda: addr3.exists() and addr3.read_text(), "the baseline gateway", 120
            )
            gw_baseline = json.loads(baseline_urls)["api"]
        for k, (speed, inst) in enumerate(zip(speeds, instances, strict=True)):
            port = free_port()
            bare = procs.start(
                f"bare-proxy-{k}",
                [sys.executable, "-c", BARE_PROXY, str(port), inst.endpoint],
                dict(os.environ),
            )
            procs.wait_for(lambda port=port: _listening(port), "the bare proxy", 60, step=0.1)
            print(f" engine decode {speed:g} tokens/s:", flush=True)
            urls = {
                "direct": inst.endpoint,
                "gateway": gw,
                "bare-proxy": f"http://127.0.0.1:{port}",
            }
            pids = {"gateway": gateway.pid, "bare-proxy": bare.pid}
            if traced is not None:
                urls["gw+tracing"], pids["gw+tracing"] = gw_traced, traced.pid
            if baseline is not None:
                urls["gw-baseline"], pids["gw-baseline"] = gw_baseline, baseline.pid
            out[f"{speed:g}"] = _overhead_one(args, f"bench-{k}", urls, pids, agent.pid, procs)
        if otel is not None:
            time.sleep(2.5)  # the batch processor exports every second
            procs.check()
            spans = otel.spans()
            out["tracing_spans_exported"] = {
                "server": sum(1 for x in spans if x.kind == 2),
                "all": len(spans),
            }
    finally:
        procs.stop_all(grace=10)
        if otel is not None:
            otel.stop()
    return out


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _overhead_one(
    args: argparse.Namespace,
    model: str,
    urls: dict[str, str],
    pids: dict[str, int],
    agent_pid: int,
    procs: Procs,
) -> dict[str, Any]:
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "how fast is the gateway"}],
            "max_tokens": args.max_tokens,
            "stream": args.stream,
        }
    ).encode()
    for url in urls.values():  # warm up connections and caches
        asyncio.run(closed_loop(url + "/v1/chat/completions", body, 8, 1.0))
    paths = list(urls)
    rounds: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
    cpu: dict[str, list[float]] = {p: [] for p in (*pids, "engine")}
    loads = []
    for r in range(args.rounds):
        order = paths if r % 2 == 0 else paths[::-1]
        for path in order:
            procs.check()  # a round against a dead child would only count errors
            loads.append(load_avg())
            p0 = cpu_seconds(pids[path]) if path in pids else 0.0
            e0 = cpu_seconds(agent_pid, tree=True)
            res = asyncio.run(
                closed_loop(
                    urls[path] + "/v1/chat/completions", body, args.concurrency, args.seconds
                )
            )
            n = max(res["n"], 1)
            if path in pids:
                cpu[path].append(1e6 * (cpu_seconds(pids[path]) - p0) / n)
            cpu["engine"].append(1e6 * (cpu_seconds(agent_pid, tree=True) - e0) / n)
            rounds[path].append(res)
            print(
                f"  round {r + 1} {path:<10} {res['rps']:8.1f} req/s  "
                f"p50 {1000 * pct(res['lat'], 50):7.2f} ms  "
                f"p99 {1000 * pct(res['lat'], 99):7.2f} ms  errors {res['errors']}",
                flush=True,
            )
    out: dict[str, Any] = {
        "load_avg_1m": loads,
        "gateway_cpu_us_per_request": statistics.median(cpu["gateway"]),
        "bare_proxy_cpu_us_per_request": statistics.median(cpu["bare-proxy"]),
        **(
            {"traced_gateway_cpu_us_per_request": statistics.median(cpu["gw+tracing"])}
            if "gw+tracing" in cpu
            else {}
        ),
        "engine_cpu_us_per_request": statistics.median(cpu["engine"]),
    }
    for path, rs in rounds.items():
        lat = [x for res in rs for x in res["lat"]]
        out[path] = {
            "rps_per_round": [round(res["rps"], 1) for res in rs],
            "rps": statistics.median(res["rps"] for res in rs),
            "p50_ms": 1000 * pct(lat, 50),
            "p90_ms": 1000 * pct(lat, 90),
            "p99_ms": 1000 * pct(lat, 99),
            "requests": len(lat),
            "errors": sum(res["errors"] for res in rs),
        }
    d, g, b = out["direct"], out["gateway"], out["bare-proxy"]
    out["bare_proxy_throughput_ratio"] = b["rps"] / d["rps"]
    out["bare_proxy_added_p99_ms"] = b["p99_ms"] - d["p99_ms"]
    out["added_p50_ms"] = g["p50_ms"] - d["p50_ms"]
    out["added_p99_ms"] = g["p99_ms"] - d["p99_ms"]
    out["throughput_ratio"] = g["rps"] / d["rps"]
    out["p50_ratio"] = g["p50_ms"] / d["p50_ms"]
    out["p99_ratio"] = g["p99_ms"] / d["p99_ms"]
    if "gw-baseline" in out:  # this code vs the baseline's, same rounds
        out["baseline_cpu_us_per_request"] = statistics.median(cpu["gw-baseline"])
        out["added_p99_ms_vs_baseline"] = g["p99_ms"] - out["gw-baseline"]["p99_ms"]
    if "gw+tracing" in out:  # tracing on vs off, same rounds
        t = out["gw+tracing"]
        out["tracing_added_p50_ms"] = t["p50_ms"] - g["p50_ms"]
        out["tracing_added_p99_ms"] = t["p99_ms"] - g["p99_ms"]
        out["tracing_throughput_ratio"] = t["rps"] / g["rps"]
    return out


# ------------------------------------------------------------------------------- cold burst


async def stream_burst(api: str, model: str, k: int) -> list[dict[str, Any]]:
    import aiohttp

    async def one(s: aiohttp.ClientSession, i: int) -> dict[str, Any]:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"burst {i}"}],
            "max_tokens": 8,
            "stream": True,
        }
        t0 = time.perf_counter()
        ttft = None
        async with s.post(f"{api}/v1/chat/completions", json=body) as r:
            async for line in r.content:
                if ttft is None and line.startswith(b"data:"):
                    ttft = time.perf_counter() - t0
            return {"status": r.status, "ttft_s": ttft, "total_s": time.perf_counter() - t0}

    async with aiohttp.ClientSession() as s:
        return await asyncio.gather(*(one(s, i) for i in range(k)))


def bench_burst(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    procs = Procs(tmp)
    results: dict[str, Any] = {}
    try:
        plane = ControlPlane.start(tmp / "plane", bin_dir=ensure_binaries())
        procs.also_check(plane.check)
        ns = plane.create_namespace("gwbench")
        st = Stack(plane, ns, tmp, procs)
        st.install()
        models = tmp / "burst-models"
        profile = {"max_batch": 64, "decode_tok_s": 100.0}
        for seed, name in enumerate(("bench-hit", "bench-cold")):
            write_model(models, name, layers=8, hidden=256, seed=seed, profile=profile)
        st.start_agents(models, {"node-a": "2x128MiB"}, copy_gbps=args.copy_gbps)
        mds = [
            {
                "apiVersion": "warmserve.io/v1alpha1",
                "kind": "ModelDeployment",
                "metadata": {"name": name, "namespace": ns},
                "spec": {
                    "model": {"name": model},
                    "maxBatchSize": 64,
                    "maxInstances": 1,
                    "prewarm": {"enabled": name == "hit"},
                },
            }
            for name, model in (("hit", "bench-hit"), ("cold", "bench-cold"))
        ]
        plane.kubectl(
            "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": mds})
        )
        seed_history(plane.kubectl, ns, "hit", "bench-hit", avg=1.0, peak=1.0)
        st.start_operator("operator", 100, poll_s=args.poll)
        gw = st.start_gateway("gw")

        def status(name: str) -> dict[str, Any]:
            return st.get("wsmd", name).get("status") or {}

        def settled() -> bool:
            reps = status("hit").get("prewarmedReplicas") or []
            return (
                bool(reps)
                and all(r["state"] == "ready" for r in reps)
                and bool(status("cold").get("conditions"))
            )

        procs.wait_for(settled, "the hit model's replica resident", 120)
        # a couple of polls: the operator leads and streams from the gateway
        _sleep(procs, 2 * args.poll)
        for case, name, model in (
            ("prewarm hit", "hit", "bench-hit"),
            ("cold start", "cold", "bench-cold"),
        ):
            t_send = time.time()
            answers = asyncio.run(stream_burst(gw.api, name, args.burst))
            held = [
                t
                for t in log_times(tmp / "gw.log", f"event=holding model={model}")
                if t >= t_send - 1
            ]
            starts = [
                t
                for t in log_times(tmp / "operator.log", f"verb=activate .*model={model}")
                if t >= t_send - 1
            ]
            act = re.findall(
                rf"event=activated .*model={model} .*hit=(\w+) seconds=([0-9.]+)",
                (tmp / "node-a.log").read_text(),
            )
            ttfts = sorted(a["ttft_s"] for a in answers if a["ttft_s"] is not None)
            results[case] = {
                "requests": args.burst,
                "ok": sum(1 for a in answers if a["status"] == 200),
                "ttft_s": [round(x, 3) for x in ttfts],
                "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
                "ttft_max_s": max(ttfts) if ttfts else None,
                "start_requested_after_first_held_s": (starts[0] - held[0])
                if held and starts
                else None,
                "prewarm_hit": act[-1][0] == "True" if act else None,
                "activation_s": float(act[-1][1]) if act else None,
            }
        results["copy_gbps"] = args.copy_gbps
        results["model_mib"] = round(
            sum(f.stat().st_size for f in (models / "bench-cold").glob("*.safetensors")) / MiB, 1
        )
    finally:
        procs.stop_all()
        stop_control_plane(tmp / "plane")
    return results


def _sleep(procs: Procs, seconds: float) -> None:
    """``time.sleep`` that ends at once when a child fails."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        procs.check()
        time.sleep(min(left, 0.3))


# ------------------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=8.0, help="length of one round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per path (interleaved)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per completion")
    ap.add_argument(
        "--decode-tok-s",
        default="30,400",
        help="engine decode speeds, tokens/s per request (comma-separated; one engine each): "
        "30 is a 7-13B model under load (the policy core's default), 400 saturates this "
        "machine's CPUs (max requests/s)",
    )
    ap.add_argument("--burst", type=int, default=16, help="requests in the cold-start burst")
    ap.add_argument("--no-burst", action="store_true", help="skip the cold-start burst")
    ap.add_argument(
        "--copy-gbps", type=float, default=0.005, help="simulated host-to-GPU GB/s (burst)"
    )
    ap.add_argument("--poll", type=float, default=5.0, help="the operator's poll seconds (burst)")
    ap.add_argument(
        "--tracing",
        action="store_true",
        help="add a gateway with tracing on (to a real collector) as a path of the same rounds",
    )
    ap.add_argument(
        "--trace-sample-ratio", type=float, default=1.0, help="the traced gateway's ratio"
    )
    ap.add_argument("--stream", action="store_true", help="streaming requests (SSE)")
    ap.add_argument(
        "--baseline-pythonpath",
        default="",
        help="PYTHONPATH of another gateway's code (e.g. an older commit unpacked with git "
        "archive: DIR/gateway:DIR) run as a path of the same rounds, gw-baseline",
    )
    ap.add_argument("--out", help="result file (default: bench/results/gateway_bench.json)")
    add_smoke_flag(ap, SMOKE, "a failed request is an error")
    args = ap.parse_args()
    apply_smoke(args, SMOKE, {"out": "bench/results/gateway_bench.json"})
    return run_supervised(lambda: _run(args), "gateway_bench")


def _run(args: argparse.Namespace) -> int:
    result: dict[str, Any] = {
        "args": vars(args),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "time_unix": time.time(),
    }
    with tempfile.TemporaryDirectory(prefix="gateway-bench-") as td:
        print(
            f"overhead: concurrency {args.concurrency}, {args.rounds} x {args.seconds:g}s "
            f"per path, {args.max_tokens} tokens per request, engines at {args.decode_tok_s} tok/s "
            f"(load avg before: {load_avg():.1f} on {os.cpu_count()} CPUs)",
            flush=True,
        )
        ov = bench_overhead(args, Path(td) / "overhead")
        result["overhead"] = ov
        if not args.no_burst:
            print(
                "cold-start burst (real kube-apiserver, operator, agent, gateway) ...", flush=True
            )
            result["burst"] = bench_burst(args, Path(td) / "burst")
    print()
    print(
        f"{'engine':<12}{'path':<11}{'req/s':>9}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}"
        f"{'errors':>7}"
    )
    for speed, o in ov.items():
        if not isinstance(o, dict) or "direct" not in o:
            continue  # tracing_spans_exported
        for name in ("direct", "gateway", "gw-baseline", "gw+tracing", "bare-proxy"):
            if name not in o:
                continue
            r = o[name]
            print(
                f"{speed + ' tok/s':<12}{name:<11}{r['rps']:>9.1f}{r['p50_ms']:>9.2f}"
                f"{r['p90_ms']:>9.2f}{r['p99_ms']:>9.2f}{r['errors']:>7}"
            )
        print(
            f"{'':<12}gateway/direct: throughput x{o['throughput_ratio']:.2f}, "
            f"p50 {o['added_p50_ms']:+.2f} ms (x{o['p50_ratio']:.2f}), "
            f"p99 {o['added_p99_ms']:+.2f} ms (x{o['p99_ratio']:.2f}); CPU per request: "
            f"gateway {o['gateway_cpu_us_per_request']:.0f} us, "
            f"bare aiohttp proxy {o['bare_proxy_cpu_us_per_request']:.0f} us, "
            f"engine {o['engine_cpu_us_per_request']:.0f} us; load avg "
            f"{min(o['load_avg_1m']):.1f}-{max(o['load_avg_1m']):.1f}"
        )
        print(
            f"{'':<12}bare aiohttp proxy/direct: throughput "
            f"x{o['bare_proxy_throughput_ratio']:.2f}, p99 {o['bare_proxy_added_p99_ms']:+.2f} ms"
        )
        if "gw-baseline" in o:
            print(
                f"{'':<12}gateway vs baseline: p99 {o['added_p99_ms_vs_baseline']:+.2f} ms; CPU "
                f"per request {o['gateway_cpu_us_per_request']:.0f} us vs "
                f"{o['baseline_cpu_us_per_request']:.0f} us"
            )
        if "gw+tracing" in o:
            print(
                f"{'':<12}tracing on/off (ratio {args.trace_sample_ratio:g}): throughput "
                f"x{o['tracing_throughput_ratio']:.2f}, p50 {o['tracing_added_p50_ms']:+.2f} ms, "
                f"p99 {o['tracing_added_p99_ms']:+.2f} ms; CPU per request "
                f"{o['traced_gateway_cpu_us_per_request']:.0f} us vs "
                f"{o['gateway_cpu_us_per_request']:.0f} us"
            )
        print(
            f"{'':<12}goal added p99 <= 5 ms: "
            + ("met" if o["added_p99_ms"] <= 5 else "NOT met")
            + "; throughput >= 0.8x direct: "
            + ("met" if o["throughput_ratio"] >= 0.8 else "NOT met")
        )
    if "tracing_spans_exported" in ov:
        n = ov["tracing_spans_exported"]
        print(f"{'':<12}the collector received {n['all']} spans ({n['server']} server spans)")
    if "burst" in result:
        b = result["burst"]
        print()
        print(
            f"cold-start burst: {args.burst} streaming requests at a model with 0 instances "
            f"({b['model_mib']} MiB weights, loads paced at {b['copy_gbps']} GB/s)"
        )
        print(
            f"{'case':<13}{'ok':>6}{'held->start':>13}{'activation':>12}"
            f"{'TTFT p50':>10}{'TTFT max':>10}"
        )
        for case in ("prewarm hit", "cold start"):
            r = b[case]
            hs, act = r["start_requested_after_first_held_s"], r["activation_s"]
            held_start = f"{1000 * hs:.0f} ms" if hs is not None else "-"
            activation = f"{act:.2f} s" if act is not None else "-"
            print(
                f"{case:<13}{r['ok']:>3}/{r['requests']:<2}{held_start:>13}{activation:>12}"
                f"{r['ttft_p50_s']:>9.2f}s{r['ttft_max_s']:>9.2f}s"
            )
            print(f"  per-request TTFT (s): {' '.join(f'{x:.2f}' for x in r['ttft_s'])}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"saved {out}")
    engines = [o for o in ov.values() if isinstance(o, dict) and "direct" in o]
    names = ("direct", "gateway", "gw+tracing", "bare-proxy")
    failed = sum(o[p]["errors"] for o in engines for p in names if p in o)
    failed += sum(r["requests"] - r["ok"] for c, r in result.get("burst", {}).items() if " " in c)
    if args.smoke and failed:
        print(f"gateway_bench: {failed} request(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
