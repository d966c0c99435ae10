from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_IDLE: _ClassVar[WorkerState]
    WORKER_STATE_UNIVERSAL: _ClassVar[WorkerState]
    WORKER_STATE_DEDICATED: _ClassVar[WorkerState]
    WORKER_STATE_GRACE: _ClassVar[WorkerState]

class SlotState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SLOT_STATE_UNSPECIFIED: _ClassVar[SlotState]
    SLOT_STATE_LOADING: _ClassVar[SlotState]
    SLOT_STATE_READY: _ClassVar[SlotState]
    SLOT_STATE_ACTIVE: _ClassVar[SlotState]
    SLOT_STATE_FAILED: _ClassVar[SlotState]

class InstancePhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_PHASE_UNSPECIFIED: _ClassVar[InstancePhase]
    INSTANCE_PHASE_STARTING: _ClassVar[InstancePhase]
    INSTANCE_PHASE_SERVING: _ClassVar[InstancePhase]
    INSTANCE_PHASE_GRACE: _ClassVar[InstancePhase]

class PreparedEngineState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREPARED_ENGINE_STATE_UNSPECIFIED: _ClassVar[PreparedEngineState]
    PREPARED_ENGINE_STATE_PREPARING: _ClassVar[PreparedEngineState]
    PREPARED_ENGINE_STATE_READY: _ClassVar[PreparedEngineState]
    PREPARED_ENGINE_STATE_FAILED: _ClassVar[PreparedEngineState]

class FetchState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FETCH_STATE_UNSPECIFIED: _ClassVar[FetchState]
    FETCH_STATE_LISTING: _ClassVar[FetchState]
    FETCH_STATE_DOWNLOADING: _ClassVar[FetchState]
    FETCH_STATE_VERIFYING: _ClassVar[FetchState]
    FETCH_STATE_DONE: _ClassVar[FetchState]
    FETCH_STATE_FAILED: _ClassVar[FetchState]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_IDLE: WorkerState
WORKER_STATE_UNIVERSAL: WorkerState
WORKER_STATE_DEDICATED: WorkerState
WORKER_STATE_GRACE: WorkerState
SLOT_STATE_UNSPECIFIED: SlotState
SLOT_STATE_LOADING: SlotState
SLOT_STATE_READY: SlotState
SLOT_STATE_ACTIVE: SlotState
SLOT_STATE_FAILED: SlotState
INSTANCE_PHASE_UNSPECIFIED: InstancePhase
INSTANCE_PHASE_STARTING: InstancePhase
INSTANCE_PHASE_SERVING: InstancePhase
INSTANCE_PHASE_GRACE: InstancePhase
PREPARED_ENGINE_STATE_UNSPECIFIED: PreparedEngineState
PREPARED_ENGINE_STATE_PREPARING: PreparedEngineState
PREPARED_ENGINE_STATE_READY: PreparedEngineState
PREPARED_ENGINE_STATE_FAILED: PreparedEngineState
FETCH_STATE_UNSPECIFIED: FetchState
FETCH_STATE_LISTING: FetchState
FETCH_STATE_DOWNLOADING: FetchState
FETCH_STATE_VERIFYING: FetchState
FETCH_STATE_DONE: FetchState
FETCH_STATE_FAILED: FetchState

class PreparedEngine(_message.Message):
    __slots__ = ("state", "engine", "worker_gpu", "host_bytes", "build_seconds", "message")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    WORKER_GPU_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUILD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    state: PreparedEngineState
    engine: str
    worker_gpu: int
    host_bytes: int
    build_seconds: float
    message: str
    def __init__(self, state: _Optional[_Union[PreparedEngineState, str]] = ..., engine: _Optional[str] = ..., worker_gpu: _Optional[int] = ..., host_bytes: _Optional[int] = ..., build_seconds: _Optional[float] = ..., message: _Optional[str] = ...) -> None: ...

class ActivationStages(_message.Message):
    __slots__ = ("process_taken_seconds", "engine_ready_seconds", "weights_resident_seconds", "kv_mapped_seconds", "endpoint_up_seconds", "first_token_seconds", "engine_prepared")
    PROCESS_TAKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_READY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_RESIDENT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_MAPPED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_UP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_PREPARED_FIELD_NUMBER: _ClassVar[int]
    process_taken_seconds: float
    engine_ready_seconds: float
    weights_resident_seconds: float
    kv_mapped_seconds: float
    endpoint_up_seconds: float
    first_token_seconds: float
    engine_prepared: bool
    def __init__(self, process_taken_seconds: _Optional[float] = ..., engine_ready_seconds: _Optional[float] = ..., weights_resident_seconds: _Optional[float] = ..., kv_mapped_seconds: _Optional[float] = ..., endpoint_up_seconds: _Optional[float] = ..., first_token_seconds: _Optional[float] = ..., engine_prepared: _Optional[bool] = ...) -> None: ...

class GpuInfo(_message.Message):
    __slots__ = ("index", "memory_bytes", "page_bytes", "pages_total", "pages_free", "free_bytes", "state", "worker_pid", "worker_restarts", "slot_ids", "instance_id", "prepared_slot_id", "prepared_engine_host_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORKER_PID_FIELD_NUMBER: _ClassVar[int]
    WORKER_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PREPARED_SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    PREPARED_ENGINE_HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    memory_bytes: int
    page_bytes: int
    pages_total: int
    pages_free: int
    free_bytes: int
    state: WorkerState
    worker_pid: int
    worker_restarts: int
    slot_ids: _containers.RepeatedScalarFieldContainer[str]
    instance_id: str
    prepared_slot_id: str
    prepared_engine_host_bytes: int
    def __init__(self, index: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., page_bytes: _Optional[int] = ..., pages_total: _Optional[int] = ..., pages_free: _Optional[int] = ..., free_bytes: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., worker_pid: _Optional[int] = ..., worker_restarts: _Optional[int] = ..., slot_ids: _Optional[_Iterable[str]] = ..., instance_id: _Optional[str] = ..., prepared_slot_id: _Optional[str] = ..., prepared_engine_host_bytes: _Optional[int] = ...) -> None: ...

class SlotInfo(_message.Message):
    __slots__ = ("slot_id", "model", "gpus", "layers_resident", "layers_total", "layers_target", "resident_bytes_per_gpu", "weight_bytes_per_gpu", "state", "message", "owner", "prepared_engine")
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    LAYERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_TARGET_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_PER_GPU_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_PER_GPU_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PREPARED_ENGINE_FIELD_NUMBER: _ClassVar[int]
    slot_id: str
    model: str
    gpus: _containers.RepeatedScalarFieldContainer[int]
    layers_resident: int
    layers_total: int
    layers_target: int
    resident_bytes_per_gpu: int
    weight_bytes_per_gpu: int
    state: SlotState
    message: str
    owner: str
    prepared_engine: PreparedEngine
    def __init__(self, slot_id: _Optional[str] = ..., model: _Optional[str] = ..., gpus: _Optional[_Iterable[int]] = ..., layers_resident: _Optional[int] = ..., layers_total: _Optional[int] = ..., layers_target: _Optional[int] = ..., resident_bytes_per_gpu: _Optional[int] = ..., weight_bytes_per_gpu: _Optional[int] = ..., state: _Optional[_Union[SlotState, str]] = ..., message: _Optional[str] = ..., owner: _Optional[str] = ..., prepared_engine: _Optional[_Union[PreparedEngine, _Mapping]] = ...) -> None: ...

class InstanceInfo(_message.Message):
    __slots__ = ("instance_id", "model", "gpus", "endpoint", "phase", "running", "waiting", "max_batch", "kv_capacity_bytes", "kv_used_bytes", "lendable_bytes", "lent_bytes", "prewarm_hit", "slot_id", "layers_resident", "layers_total", "started_unix", "owner", "grace_started_unix", "engine", "ttft_p95_seconds", "ttft_samples", "ttft_window_seconds", "dropped_requests", "stages")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LENDABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREWARM_HIT_FIELD_NUMBER: _ClassVar[int]
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    LAYERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    GRACE_STARTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    TTFT_P95_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TTFT_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TTFT_WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    model: str
    gpus: _containers.RepeatedScalarFieldContainer[int]
    endpoint: str
    phase: InstancePhase
    running: int
    waiting: int
    max_batch: int
    kv_capacity_bytes: int
    kv_used_bytes: int
    lendable_bytes: int
    lent_bytes: int
    prewarm_hit: bool
    slot_id: str
    layers_resident: int
    layers_total: int
    started_unix: float
    owner: str
    grace_started_unix: float
    engine: str
    ttft_p95_seconds: float
    ttft_samples: int
    ttft_window_seconds: float
    dropped_requests: int
    stages: ActivationStages
    def __init__(self, instance_id: _Optional[str] = ..., model: _Optional[str] = ..., gpus: _Optional[_Iterable[int]] = ..., endpoint: _Optional[str] = ..., phase: _Optional[_Union[InstancePhase, str]] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., max_batch: _Optional[int] = ..., kv_capacity_bytes: _Optional[int] = ..., kv_used_bytes: _Optional[int] = ..., lendable_bytes: _Optional[int] = ..., lent_bytes: _Optional[int] = ..., prewarm_hit: _Optional[bool] = ..., slot_id: _Optional[str] = ..., layers_resident: _Optional[int] = ..., layers_total: _Optional[int] = ..., started_unix: _Optional[float] = ..., owner: _Optional[str] = ..., grace_started_unix: _Optional[float] = ..., engine: _Optional[str] = ..., ttft_p95_seconds: _Optional[float] = ..., ttft_samples: _Optional[int] = ..., ttft_window_seconds: _Optional[float] = ..., dropped_requests: _Optional[int] = ..., stages: _Optional[_Union[ActivationStages, _Mapping]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "num_layers", "weight_bytes", "num_tensors", "max_batch", "source", "disk_bytes", "last_used_unix", "profile", "attention_heads", "kv_heads")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_layers: int
    weight_bytes: int
    num_tensors: int
    max_batch: int
    source: str
    disk_bytes: int
    last_used_unix: float
    profile: ModelProfile
    attention_heads: int
    kv_heads: int
    def __init__(self, name: _Optional[str] = ..., num_layers: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., num_tensors: _Optional[int] = ..., max_batch: _Optional[int] = ..., source: _Optional[str] = ..., disk_bytes: _Optional[int] = ..., last_used_unix: _Optional[float] = ..., profile: _Optional[_Union[ModelProfile, _Mapping]] = ..., attention_heads: _Optional[int] = ..., kv_heads: _Optional[int] = ...) -> None: ...

class ModelProfile(_message.Message):
    __slots__ = ("load_bytes_per_second", "layer_compute_seconds", "prompt_tokens", "compute_tp", "head_seconds", "head_start_seconds", "engine_overhead_bytes")
    LOAD_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    LAYER_COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_TP_FIELD_NUMBER: _ClassVar[int]
    HEAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_OVERHEAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    load_bytes_per_second: float
    layer_compute_seconds: float
    prompt_tokens: int
    compute_tp: int
    head_seconds: float
    head_start_seconds: float
    engine_overhead_bytes: int
    def __init__(self, load_bytes_per_second: _Optional[float] = ..., layer_compute_seconds: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., compute_tp: _Optional[int] = ..., head_seconds: _Optional[float] = ..., head_start_seconds: _Optional[float] = ..., engine_overhead_bytes: _Optional[int] = ...) -> None: ...

class FetchInfo(_message.Message):
    __slots__ = ("model", "source", "state", "bytes_done", "bytes_total", "bytes_per_second", "eta_seconds", "attempt", "message", "started_unix", "finished_unix")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ETA_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_FIELD_NUMBER: _ClassVar[int]
    model: str
    source: str
    state: FetchState
    bytes_done: int
    bytes_total: int
    bytes_per_second: float
    eta_seconds: float
    attempt: int
    message: str
    started_unix: float
    finished_unix: float
    def __init__(self, model: _Optional[str] = ..., source: _Optional[str] = ..., state: _Optional[_Union[FetchState, str]] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., bytes_per_second: _Optional[float] = ..., eta_seconds: _Optional[float] = ..., attempt: _Optional[int] = ..., message: _Optional[str] = ..., started_unix: _Optional[float] = ..., finished_unix: _Optional[float] = ...) -> None: ...

class StoreInfo(_message.Message):
    __slots__ = ("used_bytes", "budget_bytes", "evictions")
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    used_bytes: int
    budget_bytes: int
    evictions: int
    def __init__(self, used_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class InspectModelRequest(_message.Message):
    __slots__ = ("model", "source")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    model: str
    source: str
    def __init__(self, model: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class NodeDescription(_message.Message):
    __slots__ = ("node_name", "agent_version", "backend", "page_bytes", "gpus", "slots", "instances", "models", "generation", "agent_id", "agent_started_unix", "spare_workers", "fetches", "store")
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_STARTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    SPARE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    FETCHES_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    node_name: str
    agent_version: str
    backend: str
    page_bytes: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    slots: _containers.RepeatedCompositeFieldContainer[SlotInfo]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceInfo]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    generation: int
    agent_id: str
    agent_started_unix: float
    spare_workers: int
    fetches: _containers.RepeatedCompositeFieldContainer[FetchInfo]
    store: StoreInfo
    def __init__(self, node_name: _Optional[str] = ..., agent_version: _Optional[str] = ..., backend: _Optional[str] = ..., page_bytes: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., slots: _Optional[_Iterable[_Union[SlotInfo, _Mapping]]] = ..., instances: _Optional[_Iterable[_Union[InstanceInfo, _Mapping]]] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., generation: _Optional[int] = ..., agent_id: _Optional[str] = ..., agent_started_unix: _Optional[float] = ..., spare_workers: _Optional[int] = ..., fetches: _Optional[_Iterable[_Union[FetchInfo, _Mapping]]] = ..., store: _Optional[_Union[StoreInfo, _Mapping]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("fencing_token",)
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    fencing_token: int
    def __init__(self, fencing_token: _Optional[int] = ...) -> None: ...

class PrewarmRequest(_message.Message):
    __slots__ = ("request_id", "model", "gpus", "layers", "source", "owner", "engine", "engine_args", "fencing_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ARGS_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    gpus: _containers.RepeatedScalarFieldContainer[int]
    layers: int
    source: str
    owner: str
    engine: str
    engine_args: _containers.RepeatedScalarFieldContainer[str]
    fencing_token: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., gpus: _Optional[_Iterable[int]] = ..., layers: _Optional[int] = ..., source: _Optional[str] = ..., owner: _Optional[str] = ..., engine: _Optional[str] = ..., engine_args: _Optional[_Iterable[str]] = ..., fencing_token: _Optional[int] = ...) -> None: ...

class PrewarmProgress(_message.Message):
    __slots__ = ("slot_id", "layers_loaded", "layers_target", "bytes_loaded", "bytes_target", "bandwidth_bytes_per_s", "done", "slot", "fetch")
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_LOADED_FIELD_NUMBER: _ClassVar[int]
    LAYERS_TARGET_FIELD_NUMBER: _ClassVar[int]
    BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    BYTES_TARGET_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    slot_id: str
    layers_loaded: int
    layers_target: int
    bytes_loaded: int
    bytes_target: int
    bandwidth_bytes_per_s: float
    done: bool
    slot: SlotInfo
    fetch: FetchInfo
    def __init__(self, slot_id: _Optional[str] = ..., layers_loaded: _Optional[int] = ..., layers_target: _Optional[int] = ..., bytes_loaded: _Optional[int] = ..., bytes_target: _Optional[int] = ..., bandwidth_bytes_per_s: _Optional[float] = ..., done: _Optional[bool] = ..., slot: _Optional[_Union[SlotInfo, _Mapping]] = ..., fetch: _Optional[_Union[FetchInfo, _Mapping]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("request_id", "slot_id", "fencing_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    slot_id: str
    fencing_token: int
    def __init__(self, request_id: _Optional[str] = ..., slot_id: _Optional[str] = ..., fencing_token: _Optional[int] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("slot_id", "freed_bytes_per_gpu", "gpus")
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_PER_GPU_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    slot_id: str
    freed_bytes_per_gpu: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    def __init__(self, slot_id: _Optional[str] = ..., freed_bytes_per_gpu: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ...) -> None: ...

class ActivateRequest(_message.Message):
    __slots__ = ("request_id", "model", "gpus", "slot_id", "source", "owner", "engine", "engine_args", "fencing_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    SLOT_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ARGS_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    gpus: _containers.RepeatedScalarFieldContainer[int]
    slot_id: str
    source: str
    owner: str
    engine: str
    engine_args: _containers.RepeatedScalarFieldContainer[str]
    fencing_token: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., gpus: _Optional[_Iterable[int]] = ..., slot_id: _Optional[str] = ..., source: _Optional[str] = ..., owner: _Optional[str] = ..., engine: _Optional[str] = ..., engine_args: _Optional[_Iterable[str]] = ..., fencing_token: _Optional[int] = ...) -> None: ...

class ActivateResponse(_message.Message):
    __slots__ = ("instance", "prewarm_hit", "activation_seconds", "evicted_slot_ids")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    PREWARM_HIT_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    instance: InstanceInfo
    prewarm_hit: bool
    activation_seconds: float
    evicted_slot_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, instance: _Optional[_Union[InstanceInfo, _Mapping]] = ..., prewarm_hit: _Optional[bool] = ..., activation_seconds: _Optional[float] = ..., evicted_slot_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class BeginGraceRequest(_message.Message):
    __slots__ = ("request_id", "instance_id", "fencing_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    instance_id: str
    fencing_token: int
    def __init__(self, request_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., fencing_token: _Optional[int] = ...) -> None: ...

class BeginGraceResponse(_message.Message):
    __slots__ = ("instance",)
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    instance: InstanceInfo
    def __init__(self, instance: _Optional[_Union[InstanceInfo, _Mapping]] = ...) -> None: ...

class EndInstanceRequest(_message.Message):
    __slots__ = ("request_id", "instance_id", "evict_weights", "fencing_token")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    EVICT_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    instance_id: str
    evict_weights: bool
    fencing_token: int
    def __init__(self, request_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., evict_weights: _Optional[bool] = ..., fencing_token: _Optional[int] = ...) -> None: ...

class EndInstanceResponse(_message.Message):
    __slots__ = ("instance_id", "gpus", "slots")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    slots: _containers.RepeatedCompositeFieldContainer[SlotInfo]
    def __init__(self, instance_id: _Optional[str] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., slots: _Optional[_Iterable[_Union[SlotInfo, _Mapping]]] = ...) -> None: ...

class LendableRequest(_message.Message):
    __slots__ = ("instance_ids",)
    INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    instance_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, instance_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class LendableInfo(_message.Message):
    __slots__ = ("instance_id", "model", "gpus", "running", "max_batch", "kv_capacity_bytes", "kv_used_bytes", "reservation_target_bytes", "lendable_bytes", "lent_bytes")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_TARGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    LENDABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    model: str
    gpus: _containers.RepeatedScalarFieldContainer[int]
    running: int
    max_batch: int
    kv_capacity_bytes: int
    kv_used_bytes: int
    reservation_target_bytes: int
    lendable_bytes: int
    lent_bytes: int
    def __init__(self, instance_id: _Optional[str] = ..., model: _Optional[str] = ..., gpus: _Optional[_Iterable[int]] = ..., running: _Optional[int] = ..., max_batch: _Optional[int] = ..., kv_capacity_bytes: _Optional[int] = ..., kv_used_bytes: _Optional[int] = ..., reservation_target_bytes: _Optional[int] = ..., lendable_bytes: _Optional[int] = ..., lent_bytes: _Optional[int] = ...) -> None: ...

class LendableResponse(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[LendableInfo]
    def __init__(self, instances: _Optional[_Iterable[_Union[LendableInfo, _Mapping]]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("include_snapshot",)
    INCLUDE_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    include_snapshot: bool
    def __init__(self, include_snapshot: _Optional[bool] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("kind", "generation", "time_unix", "snapshot", "gpu", "slot", "instance", "subject_id", "message", "fetch")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[WatchEvent.Kind]
        KIND_SNAPSHOT: _ClassVar[WatchEvent.Kind]
        KIND_GPU: _ClassVar[WatchEvent.Kind]
        KIND_SLOT: _ClassVar[WatchEvent.Kind]
        KIND_SLOT_REMOVED: _ClassVar[WatchEvent.Kind]
        KIND_INSTANCE: _ClassVar[WatchEvent.Kind]
        KIND_INSTANCE_REMOVED: _ClassVar[WatchEvent.Kind]
        KIND_WORKER_REPLACED: _ClassVar[WatchEvent.Kind]
        KIND_FETCH: _ClassVar[WatchEvent.Kind]
    KIND_UNSPECIFIED: WatchEvent.Kind
    KIND_SNAPSHOT: WatchEvent.Kind
    KIND_GPU: WatchEvent.Kind
    KIND_SLOT: WatchEvent.Kind
    KIND_SLOT_REMOVED: WatchEvent.Kind
    KIND_INSTANCE: WatchEvent.Kind
    KIND_INSTANCE_REMOVED: WatchEvent.Kind
    KIND_WORKER_REPLACED: WatchEvent.Kind
    KIND_FETCH: WatchEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    kind: WatchEvent.Kind
    generation: int
    time_unix: float
    snapshot: NodeDescription
    gpu: GpuInfo
    slot: SlotInfo
    instance: InstanceInfo
    subject_id: str
    message: str
    fetch: FetchInfo
    def __init__(self, kind: _Optional[_Union[WatchEvent.Kind, str]] = ..., generation: _Optional[int] = ..., time_unix: _Optional[float] = ..., snapshot: _Optional[_Union[NodeDescription, _Mapping]] = ..., gpu: _Optional[_Union[GpuInfo, _Mapping]] = ..., slot: _Optional[_Union[SlotInfo, _Mapping]] = ..., instance: _Optional[_Union[InstanceInfo, _Mapping]] = ..., subject_id: _Optional[str] = ..., message: _Optional[str] = ..., fetch: _Optional[_Union[FetchInfo, _Mapping]] = ...) -> None: ...
