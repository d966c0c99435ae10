"""Typed values crossing the engine boundary: what an engine is given and what it reports.

:class:`EngineSpec` is everything an engine needs to serve one instance from an activated slot
(WarmServe §4: weights at the start of the slot, KV cache in the pages after them).  It is built
by the agent core (``NodeCore``), sent to the worker process that hosts the engine (pickled over
the worker pipe: plain frozen dataclasses), and never re-interpreted by anything in between.

Where the weights are has **one shape**, :class:`SlotRegion`, per tensor-parallel rank: the
slot's virtual address on that rank's GPU, the bytes of weights and KV cache behind it, and —
when the memory is the simulated backend's shared file — the file and the physical page of every
virtual page, so a process that does not own the memory can still map it (``slotmem``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from warmserve_agent.engines.kv_geometry import KvGeometry


class PreparedState(StrEnum):
    """Where a slot's prepared engine is (wire: ``PreparedEngineState``)."""

    NONE = "none"  # not asked for, or its worker holds another slot's engine
    PREPARING = "preparing"
    READY = "ready"
    FAILED = "failed"  # Activate builds the engine itself


@dataclass(frozen=True, slots=True)
class SlotRegion:
    """One rank's part of a slot: ``[va, va + weight_bytes)`` weights, then KV cache.

    ``va`` is a virtual address in the process that owns the GPU's memory (the agent for the
    simulated backend by default, the GPU's worker with ``--memory-in-workers`` or CUDA).
    ``host_file``/``ppages`` are set only for the simulated backend's shared files: physical page
    ``p`` is bytes ``[p * page_bytes, (p + 1) * page_bytes)`` of ``host_file``; ``ppages[i]``
    backs virtual page ``i`` of the slot (weights then KV pages, as mapped at activation).
    ``local`` is true for the rank whose worker hosts the engine (it owns ``va`` itself).
    ``page_table`` (simulated backend) is the slot's shared page-table file on that GPU: the
    physical page behind each virtual page *now*, for KV pages mapped after the engine started
    and for the engine's page-access checks (``backends/simulated.py``).  A ``ppages`` entry of
    -1 is a page not mapped when the spec was made.
    """

    gpu: int
    va: int
    page_bytes: int
    weight_bytes: int
    kv_bytes: int
    local: bool = False
    host_file: str = ""
    ppages: tuple[int, ...] = ()
    page_table: str = ""

    @property
    def mapped_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


@dataclass(frozen=True, slots=True)
class TensorPlacement:
    """A checkpoint tensor in the slot: rank ``r``'s shard is ``shard_len[r]`` bytes at
    ``offset`` (``store.SlotLayout``), in ``slot_bytes`` reserved on every rank; ``split`` is how
    the ranks split it (``warmserve.policy.tensor_parallel.Split``: ``bytes`` is no split an
    engine's tensor-parallel layers know)."""

    name: str
    layer: int
    offset: int
    nbytes: int
    dtype: str  # safetensors dtype: BF16, F16, F32, ...
    shape: tuple[int, ...]
    shard_len: tuple[int, ...]
    split: str = "replicated"
    slot_bytes: int = 0


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """Pacing of the simulated engine and the model's batch limit C (Eq. 1)."""

    max_batch: int = 32
    prefill_tok_s: float = 20000.0
    decode_tok_s: float = 200.0
    kv_bytes_per_token: int = 4096
    max_waiting: int = 0  # queue bound; 0: 4 x max_batch


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What an engine needs to serve one instance (see module docstring)."""

    engine: str
    model: str
    instance_id: str
    model_dir: str  # config.json, tokenizer files; the weights are read from the slot only
    layers_total: int
    layers_resident: int
    # KV the engine may use at start, summed over the group; the KV range (``regions[r].kv_bytes``)
    # is mapped in the background and ``set_kv_capacity`` raises this as pages land
    kv_capacity_bytes: int
    regions: tuple[SlotRegion, ...]  # one per tensor-parallel rank
    tensors: tuple[TensorPlacement, ...]
    digests: tuple[tuple[str, ...], ...]  # per rank, blake2b-128 hex of each tensor's shard
    profile: EngineProfile = field(default_factory=EngineProfile)
    engine_args: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    advertise_host: str = ""
    port: int = 0
    # OTLP/HTTP receiver the engine exports its spans to ("" off; the agent's flag) and the
    # ratio of new traces it samples (requests with a parent follow the parent).
    traces_endpoint: str = ""
    trace_sample_ratio: float = 1.0
    # The slot the engine serves from.  A spec made at prewarm time (``Engine.prepare``) has no
    # instance yet (``instance_id`` empty), KV pages not mapped (``ppages`` -1) and the KV bytes
    # the slot will get at activation; Activate's spec names the same slot.
    slot_id: str = ""
    # the agent's engine-event socket (engine_events.py: request completions, KV wanted); "" off
    events_addr: str = ""
    # Tensor parallelism over pooled workers (vllm/tp_executor.py): rank r >= 1 listens on
    # ``tp_peers[r - 1]`` (Unix sockets in the agent's private directory, ``tp_authkey`` hex),
    # the ranks' process group meets at ``tp_init`` (a file store there).  Empty for TP 1.
    tp_peers: tuple[str, ...] = ()
    tp_init: str = ""
    tp_authkey: str = ""

    @property
    def tp_size(self) -> int:
        return len(self.regions)

    @property
    def page_bytes(self) -> int:
        return self.regions[0].page_bytes

    def prepared_key(self) -> tuple[object, ...]:
        """What a prepared engine was built for: an Activate whose spec differs in any of these
        cannot use it (the engine is built again)."""
        return (
            self.engine,
            self.model,
            self.slot_id,
            self.model_dir,
            self.layers_total,
            self.engine_args,
            self.host,
            self.advertise_host,
            self.traces_endpoint,
            self.trace_sample_ratio,
            self.profile,
            tuple((r.gpu, r.va, r.page_bytes, r.weight_bytes, r.local) for r in self.regions),
            self.tp_peers,
            self.tp_init,
            self.tp_authkey,
        )

    def url(self, port: int) -> str:
        host = self.advertise_host or self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 literal needs brackets in a URL (RFC 3986)
        return f"http://{host}:{port}"


@dataclass(frozen=True, slots=True)
class EngineStages:
    """How an engine's ``start`` spent its time, in seconds since ``start`` was called.

    ``prepared``: the engine was built before (``Engine.prepare``, at prewarm) and ``start`` only
    took the KV the agent had mapped and opened the endpoint.  ``kv_mapped_s``: when ``start``
    had grown the KV cache over what the spec granted — the activation's KV stage only when that
    was the whole range (else the agent's pager completes it later: ``activation_stages.py``).
    ``first_token_s`` is None until the engine produced its first output token."""

    prepared: bool = False
    engine_ready_s: float = 0.0
    kv_mapped_s: float = 0.0
    endpoint_up_s: float = 0.0
    first_token_s: float | None = None


@dataclass(frozen=True, slots=True)
class PreparedReport:
    """A prepared engine's state in its process; ``host_bytes``: the growth of the process's
    anonymous resident memory while it was built (what it costs while it waits)."""

    state: PreparedState
    seconds: float = 0.0
    host_bytes: int = 0
    message: str = ""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """An engine's load, from its own scheduler (Eq. 1's R, K, M) and its TTFT observations.

    ``ttft_p95_s`` is the 95th percentile of time to first token over the requests that got
    their first token in the last ``ttft_window_s`` seconds (``ttft_samples`` of them; 0 and 0.0
    when none)."""

    running: int = 0
    waiting: int = 0
    kv_used_bytes: int = 0
    kv_capacity_bytes: int = 0
    kv_reserved_bytes: int = 0
    layers_resident: int = 0
    max_batch: int = 0  # the engine's batch limit (C of Eq. 1); 0: use the model profile's
    served: int = 0
    dropped: int = 0  # requests refused (queue full) or abandoned by their client
    ttft_p95_s: float = 0.0
    ttft_samples: int = 0
    ttft_window_s: float = 0.0
    bad_tensors: tuple[str, ...] = ()
    stages: EngineStages = field(default_factory=EngineStages)
    # KV bytes (summed over the group) waiting requests need beyond the free capacity: a grace
    # instance whose lent KV must grow back (Eq. 1 plus demand, grace_lending.py)
    kv_wanted_bytes: int = 0
    # where the engine's KV blocks lie in its KV range (None: one block per page from the start)
    kv_geometry: KvGeometry | None = None
