"""The node agent's settings (:class:`AgentConfig`) and how a bad one is reported.

What ``warmserve agent``'s flags (and the tests) set; :class:`~warmserve_agent.server.AgentServer`
checks the combinations when it starts and refuses a bad one with :class:`ConfigError`, which the
CLI prints as one line.  ``--simulate-gpus COUNTxSIZE`` (:func:`parse_simulated_gpus`) runs the
agent without GPUs: the same page pools (§4.2) over simulated device memory.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from warmserve.engine_args import DEFAULT_POLICY, EngineArgPolicy
from warmserve.units import SizeError, parse_size
from warmserve_agent.sources.disk_reserve import DEFAULT_RESERVE, DiskReserve

FENCING_FILE = ".warmserve-fencing.json"  # hidden: the store's catalogue skips it
_GPUS_RE = re.compile(r"^\s*(\d+)\s*x\s*(.+)$")


class ConfigError(ValueError):
    """A bad agent setting (the CLI prints it as one line)."""


def parse_simulated_gpus(spec: str) -> list[int]:
    """``"8x80GiB"`` or ``"2x80GiB,2x40GiB"`` -> per-GPU memory sizes."""
    out: list[int] = []
    for part in spec.split(","):
        m = _GPUS_RE.match(part)
        if not m:
            raise ConfigError(f"bad --simulate-gpus {spec!r}: use COUNTxSIZE, e.g. 8x80GiB")
        n = int(m.group(1))
        if not 1 <= n <= 64:
            raise ConfigError(f"bad --simulate-gpus {spec!r}: 1-64 GPUs per part")
        try:
            size = parse_size(m.group(2), f"--simulate-gpus {spec!r}", require_unit=True)
        except SizeError as exc:
            raise ConfigError(str(exc)) from None
        out += [size] * n
    return out


@dataclass
class AgentConfig:
    model_dir: Path
    simulate_gpus: list[int] | None = None  # None: real GPUs through the cuda backend
    listen: str = "127.0.0.1:50051"
    node_name: str = field(default_factory=socket.gethostname)
    page_bytes: int = 2 * 1024**2
    memory_dir: Path | None = None  # simulated GPU memory files (default: <memory_root>/...)
    # Parent of per-agent memory directories; dead agents' directories there are removed at start.
    memory_root: Path = Path("/dev/shm")
    keep_memory: bool = False  # keep simulated memory files at exit
    spare_workers: int = 1
    recycle_workers: bool = False  # replace a GPU's worker process after each instance ends
    # Whether each GPU's worker process owns its memory (None: yes for CUDA, no for simulated).
    memory_in_workers: bool | None = None
    use_workers: bool = True  # False: engines in the agent process (tests, debugging)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    client_ca: Path | None = None
    # Mutual TLS: client certificates allowed to call everything (CN=... or URI SANs; empty:
    # warmserve_agent.auth.DEFAULT_CALLER_ID, the operator's) and allowed to read only.
    client_ids: tuple[str, ...] = ()
    reader_ids: tuple[str, ...] = ()
    token_file: Path | None = None
    # Fencing tokens (warmserve_agent.fencing): where the highest operator leadership term seen
    # is kept across restarts (None: <model_dir>/.warmserve-fencing.json, the node's persistent
    # store), and whether a mutating call without a token is refused.
    fencing_file: Path | None = None
    require_fencing_token: bool = False
    # How far one call may raise the fence (warmserve_agent.fencing.Bounds).
    fencing_max_skew_s: float = 300.0
    fencing_max_term_jump: int = 1024
    # Accept serving the API on a non-loopback address with no authentication (logged loudly).
    allow_insecure_listen: bool = False
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"  # 0.0.0.0 in a pod, so Prometheus can scrape it
    engine_host: str = "127.0.0.1"  # where engines bind their OpenAI endpoints
    advertise_host: str = ""  # host in the endpoints Activate returns (default: engine_host)
    # Eq. 1 is re-checked when a grace instance's request completes (the engine's event,
    # engine_events.py); this timer is only the safety net for a lost event.
    grace_interval_s: float = 5.0
    # Watch streams: events buffered per client, and how long a client may take to accept one
    # before it is dropped (it stopped reading).
    watch_queue_max: int = 1024
    watch_write_timeout_s: float = 30.0
    monitor_interval_s: float = 0.5
    host_cache_bytes: int = 8 * 1024**3
    # Real GPUs: device memory left outside the page pool for an engine's own allocations
    # (activations, CUDA graphs, workspaces); the pool is sized from *free* memory minus this.
    gpu_reserve_bytes: int = 4 * 1024**3
    # Simulated backend timing model (0: off): host-to-GPU copy bandwidth and map cost per page.
    sim_copy_bytes_per_s: float = 0.0
    sim_map_s_per_page: float = 0.0
    # Filling the store from model sources (warmserve_agent.sources): budget 0 = the disk's free
    # space only; the token and credentials come from files/environment, never from a request.
    store_budget_bytes: int = 0
    store_reserve: DiskReserve = DEFAULT_RESERVE  # free disk a fetch never takes
    fetch_attempts: int = 3
    fetch_backoff_s: float = 1.0
    hf_endpoint: str = ""
    hf_token_file: Path | None = None
    s3_endpoint_url: str = ""
    s3_region: str = ""
    pvc_root: Path = Path("/mnt/warmserve/pvc")
    allowed_paths: tuple[Path, ...] = ()
    # Engines export OpenTelemetry traces here (the simulated engine; vLLM's
    # --otlp-traces-endpoint): set by the agent's flag, never by a tenant's engine args.
    engine_traces_endpoint: str = ""
    engine_trace_sample_ratio: float = 1.0
    engines: tuple[str, ...] = ("simulated",)  # what workers preload and may host
    default_engine: str = ""  # for Activate calls naming none (default: engines[0])
    # What an Activate's engine_args may contain (--allow-engine-arg; docs/security.md): checked
    # here again although the operator admits deployments with the same allowlist.
    engine_policy: EngineArgPolicy = DEFAULT_POLICY

    @property
    def fencing_path(self) -> Path:
        return self.fencing_file or Path(self.model_dir) / FENCING_FILE
