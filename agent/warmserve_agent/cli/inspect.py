"""``warmserve agent inspect ADDR``: show what a node agent holds (its ``Describe`` answer).

GPUs and their workers, prewarm slots, model fetches and the store, and instances, as tables;
``--json`` prints the NodeDescription message itself.  See docs/agent.md.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from warmserve.flags import CliError
from warmserve.textfmt import columns


def _gib(n: int) -> str:
    if n >= 1024**3:
        return f"{n / 1024**3:.2f}GiB"
    if n >= 1024**2 or n == 0:
        return f"{n / 1024**2:.1f}MiB"
    return f"{n / 1024:.0f}KiB"


def render(d: Any) -> str:
    """Human-readable view of a NodeDescription."""
    from warmserve.api.agent.client import pb
    from warmserve.api.agent.wire import instance_phase, slot_state, worker_state

    state = {v: worker_state(v).value for v in pb.WorkerState.values()}
    sstate = {v: slot_state(v).value for v in pb.SlotState.values()}
    phase = {v: instance_phase(v).value for v in pb.InstancePhase.values()}
    out = [
        f"node {d.node_name}  backend {d.backend}  agent {d.agent_version} ({d.agent_id[:8]})  "
        f"page {_gib(d.page_bytes)}  spare workers {d.spare_workers}  generation {d.generation}",
        "",
        "GPUS",
    ]
    rows = [["GPU", "STATE", "MEMORY", "FREE", "PAGES FREE/TOTAL", "WORKER", "RESTARTS", "SLOTS"]]
    for g in d.gpus:
        rows.append(
            [
                str(g.index),
                state[g.state],
                _gib(g.memory_bytes),
                _gib(g.free_bytes),
                f"{g.pages_free}/{g.pages_total}",
                str(g.worker_pid or "-"),
                str(g.worker_restarts),
                str(len(g.slot_ids)),
            ]
        )
    out += [columns(rows), "", "SLOTS"]
    if d.slots:
        rows = [["SLOT", "MODEL", "GPUS", "LAYERS", "BYTES/GPU", "STATE"]]
        for s in d.slots:
            rows.append(
                [
                    s.slot_id,
                    s.model,
                    ",".join(map(str, s.gpus)),
                    f"{s.layers_resident}/{s.layers_total}",
                    f"{_gib(s.resident_bytes_per_gpu)}/{_gib(s.weight_bytes_per_gpu)}",
                    sstate[s.state] + (f" ({s.message})" if s.message else ""),
                ]
            )
        out.append(columns(rows))
    else:
        out.append("(none)")
    if d.fetches or d.store.budget_bytes or d.store.used_bytes:
        fstate = {v: k.removeprefix("FETCH_STATE_").lower() for k, v in pb.FetchState.items()}
        budget = _gib(d.store.budget_bytes) if d.store.budget_bytes else "none"
        out += [
            "",
            f"STORE  used {_gib(d.store.used_bytes)}  budget {budget}  "
            f"evictions {d.store.evictions}",
        ]
        if d.fetches:
            rows = [["FETCHING", "FROM", "STATE", "BYTES", "RATE", "ETA", "TRY"]]
            for f in d.fetches:
                rows.append(
                    [
                        f.model,
                        f.source,
                        fstate[f.state] + (f" ({f.message})" if f.message else ""),
                        f"{_gib(f.bytes_done)}/{_gib(f.bytes_total)}",
                        f"{_gib(int(f.bytes_per_second))}/s",
                        f"{f.eta_seconds:.0f}s" if f.eta_seconds else "-",
                        str(f.attempt),
                    ]
                )
            out.append(columns(rows))
    out += ["", "INSTANCES"]
    if d.instances:
        rows = [
            ["INSTANCE", "MODEL", "GPUS", "PHASE", "ENDPOINT", "RUN/WAIT", "KV USED/CAP", "LEND"]
        ]
        for i in d.instances:
            rows.append(
                [
                    i.instance_id,
                    i.model,
                    ",".join(map(str, i.gpus)),
                    phase[i.phase] + (" (hit)" if i.prewarm_hit else ""),
                    i.endpoint,
                    f"{i.running}/{i.waiting}",
                    f"{_gib(i.kv_used_bytes)}/{_gib(i.kv_capacity_bytes)}",
                    _gib(i.lendable_bytes) if i.phase == pb.INSTANCE_PHASE_GRACE else "-",
                ]
            )
        out.append(columns(rows))
    else:
        out.append("(none)")
    return "\n".join(out)


def inspect_agent(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from warmserve.api.agent.client import AgentError, SyncAgentClient

    try:
        with SyncAgentClient(
            args.address,
            token_file=args.client_token_file,
            ca_cert=args.ca_cert,
            client_cert=args.client_cert,
            client_key=args.client_key,
            server_name=args.server_name,
            timeout_s=args.timeout,
        ) as c:
            d = c.describe()
    except AgentError as exc:
        raise CliError(f"agent at {args.address}: {exc}") from None
    if args.json:
        print(json.dumps(MessageToDict(d, preserving_proto_field_name=True), indent=2))
    else:
        print(render(d))
    return 0
