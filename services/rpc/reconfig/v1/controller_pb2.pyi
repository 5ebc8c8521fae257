from services.rpc.reconfig.v1 import router_pb2 as _router_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StackState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STACK_STATE_UNSPECIFIED: _ClassVar[StackState]
    STACK_STATE_STARTING: _ClassVar[StackState]
    STACK_STATE_SERVING: _ClassVar[StackState]
    STACK_STATE_FROZEN: _ClassVar[StackState]
    STACK_STATE_DEGRADED: _ClassVar[StackState]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_ACTIVE: _ClassVar[WorkerState]
    WORKER_STATE_STANDBY: _ClassVar[WorkerState]
    WORKER_STATE_UNREACHABLE: _ClassVar[WorkerState]

class OperationState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPERATION_STATE_UNSPECIFIED: _ClassVar[OperationState]
    OPERATION_STATE_RUNNING: _ClassVar[OperationState]
    OPERATION_STATE_SUCCEEDED: _ClassVar[OperationState]
    OPERATION_STATE_FAILED: _ClassVar[OperationState]
    OPERATION_STATE_ROLLED_BACK: _ClassVar[OperationState]
STACK_STATE_UNSPECIFIED: StackState
STACK_STATE_STARTING: StackState
STACK_STATE_SERVING: StackState
STACK_STATE_FROZEN: StackState
STACK_STATE_DEGRADED: StackState
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_ACTIVE: WorkerState
WORKER_STATE_STANDBY: WorkerState
WORKER_STATE_UNREACHABLE: WorkerState
OPERATION_STATE_UNSPECIFIED: OperationState
OPERATION_STATE_RUNNING: OperationState
OPERATION_STATE_SUCCEEDED: OperationState
OPERATION_STATE_FAILED: OperationState
OPERATION_STATE_ROLLED_BACK: OperationState

class GetAutopilotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetAutopilotRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    def __init__(self, mode: _Optional[str] = ...) -> None: ...

class LayoutProfile(_message.Message):
    __slots__ = ("layout", "step_seconds", "per_request_seconds", "per_position_seconds", "prefill_base_seconds", "prefill_per_token_seconds", "kv_blocks", "block_size", "num_workers", "kv_pools", "balanced_layers")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PER_REQUEST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PER_POSITION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PER_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    KV_POOLS_FIELD_NUMBER: _ClassVar[int]
    BALANCED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    layout: str
    step_seconds: float
    per_request_seconds: float
    per_position_seconds: float
    prefill_base_seconds: float
    prefill_per_token_seconds: float
    kv_blocks: int
    block_size: int
    num_workers: int
    kv_pools: int
    balanced_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layout: _Optional[str] = ..., step_seconds: _Optional[float] = ..., per_request_seconds: _Optional[float] = ..., per_position_seconds: _Optional[float] = ..., prefill_base_seconds: _Optional[float] = ..., prefill_per_token_seconds: _Optional[float] = ..., kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_workers: _Optional[int] = ..., kv_pools: _Optional[int] = ..., balanced_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class SwitchCost(_message.Message):
    __slots__ = ("from_topology", "to_topology", "downtime_seconds", "staging_seconds")
    FROM_TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    TO_TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    DOWNTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STAGING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    from_topology: str
    to_topology: str
    downtime_seconds: float
    staging_seconds: float
    def __init__(self, from_topology: _Optional[str] = ..., to_topology: _Optional[str] = ..., downtime_seconds: _Optional[float] = ..., staging_seconds: _Optional[float] = ...) -> None: ...

class LoadBand(_message.Message):
    __slots__ = ("low", "high", "layout")
    LOW_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    low: float
    high: float
    layout: str
    def __init__(self, low: _Optional[float] = ..., high: _Optional[float] = ..., layout: _Optional[str] = ...) -> None: ...

class AutopilotStatus(_message.Message):
    __slots__ = ("mode", "live_topology", "profile_path", "profile_machine", "profile_created_unix", "layouts", "switches", "bands", "bands_context_tokens", "action", "target", "reason", "decided_at_unix", "predicted_tpot_seconds", "thresholds", "load", "kv_blocks_used", "context_tokens", "arrival_rate", "ttft_p99_seconds", "tpot_mean_seconds", "has_forecast", "forecast_load", "intent_window", "allowed", "rejected", "num_switches", "last_operation_id", "last_outcome", "error", "calibrating", "worker_layer_seconds", "head_layers", "learned_corrections")
    class PredictedTpotSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ThresholdsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class WorkerLayerSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    class LearnedCorrectionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODE_FIELD_NUMBER: _ClassVar[int]
    LIVE_TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    PROFILE_PATH_FIELD_NUMBER: _ClassVar[int]
    PROFILE_MACHINE_FIELD_NUMBER: _ClassVar[int]
    PROFILE_CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    BANDS_FIELD_NUMBER: _ClassVar[int]
    BANDS_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TPOT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_RATE_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MEAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HAS_FORECAST_FIELD_NUMBER: _ClassVar[int]
    FORECAST_LOAD_FIELD_NUMBER: _ClassVar[int]
    INTENT_WINDOW_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    NUM_SWITCHES_FIELD_NUMBER: _ClassVar[int]
    LAST_OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CALIBRATING_FIELD_NUMBER: _ClassVar[int]
    WORKER_LAYER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEAD_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LEARNED_CORRECTIONS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    live_topology: str
    profile_path: str
    profile_machine: str
    profile_created_unix: float
    layouts: _containers.RepeatedCompositeFieldContainer[LayoutProfile]
    switches: _containers.RepeatedCompositeFieldContainer[SwitchCost]
    bands: _containers.RepeatedCompositeFieldContainer[LoadBand]
    bands_context_tokens: float
    action: str
    target: str
    reason: str
    decided_at_unix: float
    predicted_tpot_seconds: _containers.ScalarMap[str, float]
    thresholds: _containers.ScalarMap[str, float]
    load: int
    kv_blocks_used: int
    context_tokens: float
    arrival_rate: float
    ttft_p99_seconds: float
    tpot_mean_seconds: float
    has_forecast: bool
    forecast_load: float
    intent_window: str
    allowed: _containers.RepeatedScalarFieldContainer[str]
    rejected: _containers.ScalarMap[str, str]
    num_switches: int
    last_operation_id: str
    last_outcome: str
    error: str
    calibrating: str
    worker_layer_seconds: _containers.ScalarMap[int, float]
    head_layers: float
    learned_corrections: _containers.ScalarMap[str, float]
    def __init__(self, mode: _Optional[str] = ..., live_topology: _Optional[str] = ..., profile_path: _Optional[str] = ..., profile_machine: _Optional[str] = ..., profile_created_unix: _Optional[float] = ..., layouts: _Optional[_Iterable[_Union[LayoutProfile, _Mapping]]] = ..., switches: _Optional[_Iterable[_Union[SwitchCost, _Mapping]]] = ..., bands: _Optional[_Iterable[_Union[LoadBand, _Mapping]]] = ..., bands_context_tokens: _Optional[float] = ..., action: _Optional[str] = ..., target: _Optional[str] = ..., reason: _Optional[str] = ..., decided_at_unix: _Optional[float] = ..., predicted_tpot_seconds: _Optional[_Mapping[str, float]] = ..., thresholds: _Optional[_Mapping[str, float]] = ..., load: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., context_tokens: _Optional[float] = ..., arrival_rate: _Optional[float] = ..., ttft_p99_seconds: _Optional[float] = ..., tpot_mean_seconds: _Optional[float] = ..., has_forecast: _Optional[bool] = ..., forecast_load: _Optional[float] = ..., intent_window: _Optional[str] = ..., allowed: _Optional[_Iterable[str]] = ..., rejected: _Optional[_Mapping[str, str]] = ..., num_switches: _Optional[int] = ..., last_operation_id: _Optional[str] = ..., last_outcome: _Optional[str] = ..., error: _Optional[str] = ..., calibrating: _Optional[str] = ..., worker_layer_seconds: _Optional[_Mapping[int, float]] = ..., head_layers: _Optional[float] = ..., learned_corrections: _Optional[_Mapping[str, float]] = ...) -> None: ...

class CalibrateRequest(_message.Message):
    __slots__ = ("layouts", "batch_sizes", "prompt_tokens", "output_tokens")
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    layouts: _containers.RepeatedScalarFieldContainer[str]
    batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    output_tokens: int
    def __init__(self, layouts: _Optional[_Iterable[str]] = ..., batch_sizes: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., output_tokens: _Optional[int] = ...) -> None: ...

class CalibrateProgress(_message.Message):
    __slots__ = ("message", "done", "status")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    message: str
    done: float
    status: AutopilotStatus
    def __init__(self, message: _Optional[str] = ..., done: _Optional[float] = ..., status: _Optional[_Union[AutopilotStatus, _Mapping]] = ...) -> None: ...

class AddWorkerRequest(_message.Message):
    __slots__ = ("address", "topology", "operation_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    topology: str
    operation_id: str
    def __init__(self, address: _Optional[str] = ..., topology: _Optional[str] = ..., operation_id: _Optional[str] = ...) -> None: ...

class ReconfigureRequest(_message.Message):
    __slots__ = ("topology", "operation_id", "deadline_seconds", "strategy", "dry_run", "layer_partition")
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    LAYER_PARTITION_FIELD_NUMBER: _ClassVar[int]
    topology: str
    operation_id: str
    deadline_seconds: float
    strategy: str
    dry_run: bool
    layer_partition: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, topology: _Optional[str] = ..., operation_id: _Optional[str] = ..., deadline_seconds: _Optional[float] = ..., strategy: _Optional[str] = ..., dry_run: _Optional[bool] = ..., layer_partition: _Optional[_Iterable[int]] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("topology", "layer_partition")
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    LAYER_PARTITION_FIELD_NUMBER: _ClassVar[int]
    topology: str
    layer_partition: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, topology: _Optional[str] = ..., layer_partition: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerPlan(_message.Message):
    __slots__ = ("rank", "state_before", "state_after", "kv_bytes_in", "kv_bytes_local", "weight_bytes_load", "weight_bytes_keep", "peak_extra_bytes", "num_kv_blocks_after", "weight_bytes_reshard", "expert_peak_extra_bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_BEFORE_FIELD_NUMBER: _ClassVar[int]
    STATE_AFTER_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_LOCAL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_LOAD_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_KEEP_FIELD_NUMBER: _ClassVar[int]
    PEAK_EXTRA_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_AFTER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_RESHARD_FIELD_NUMBER: _ClassVar[int]
    EXPERT_PEAK_EXTRA_BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    state_before: str
    state_after: str
    kv_bytes_in: int
    kv_bytes_local: int
    weight_bytes_load: int
    weight_bytes_keep: int
    peak_extra_bytes: int
    num_kv_blocks_after: int
    weight_bytes_reshard: int
    expert_peak_extra_bytes: int
    def __init__(self, rank: _Optional[int] = ..., state_before: _Optional[str] = ..., state_after: _Optional[str] = ..., kv_bytes_in: _Optional[int] = ..., kv_bytes_local: _Optional[int] = ..., weight_bytes_load: _Optional[int] = ..., weight_bytes_keep: _Optional[int] = ..., peak_extra_bytes: _Optional[int] = ..., num_kv_blocks_after: _Optional[int] = ..., weight_bytes_reshard: _Optional[int] = ..., expert_peak_extra_bytes: _Optional[int] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("from_topology", "to_topology", "workers", "num_used_blocks", "num_kv_blocks_after", "num_requests_preempted", "fits", "is_candidate", "stages", "staging_note", "placements", "pools")
    FROM_TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    TO_TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_AFTER_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    FITS_FIELD_NUMBER: _ClassVar[int]
    IS_CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    STAGING_NOTE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    from_topology: str
    to_topology: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerPlan]
    num_used_blocks: int
    num_kv_blocks_after: int
    num_requests_preempted: int
    fits: bool
    is_candidate: bool
    stages: bool
    staging_note: str
    placements: _containers.RepeatedCompositeFieldContainer[_router_pb2.RequestPlacement]
    pools: _containers.RepeatedCompositeFieldContainer[PoolPlan]
    def __init__(self, from_topology: _Optional[str] = ..., to_topology: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerPlan, _Mapping]]] = ..., num_used_blocks: _Optional[int] = ..., num_kv_blocks_after: _Optional[int] = ..., num_requests_preempted: _Optional[int] = ..., fits: _Optional[bool] = ..., is_candidate: _Optional[bool] = ..., stages: _Optional[bool] = ..., staging_note: _Optional[str] = ..., placements: _Optional[_Iterable[_Union[_router_pb2.RequestPlacement, _Mapping]]] = ..., pools: _Optional[_Iterable[_Union[PoolPlan, _Mapping]]] = ...) -> None: ...

class PoolPlan(_message.Message):
    __slots__ = ("pool", "num_requests", "num_blocks")
    POOL_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    pool: int
    num_requests: int
    num_blocks: int
    def __init__(self, pool: _Optional[int] = ..., num_requests: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchStatusRequest(_message.Message):
    __slots__ = ("interval_seconds",)
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    interval_seconds: float
    def __init__(self, interval_seconds: _Optional[float] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("rank", "pid", "state", "device", "address", "pp_rank", "tp_rank", "layer_start", "layer_end", "kv_head_start", "kv_head_end", "num_kv_blocks_used", "num_kv_blocks_total", "param_bytes", "kv_cache_bytes", "error", "numerics", "dtype", "gemm", "kernels")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_END_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    GEMM_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    state: WorkerState
    device: str
    address: str
    pp_rank: int
    tp_rank: int
    layer_start: int
    layer_end: int
    kv_head_start: int
    kv_head_end: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    param_bytes: int
    kv_cache_bytes: int
    error: str
    numerics: str
    dtype: str
    gemm: str
    kernels: str
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., device: _Optional[str] = ..., address: _Optional[str] = ..., pp_rank: _Optional[int] = ..., tp_rank: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., kv_head_end: _Optional[int] = ..., num_kv_blocks_used: _Optional[int] = ..., num_kv_blocks_total: _Optional[int] = ..., param_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., error: _Optional[str] = ..., numerics: _Optional[str] = ..., dtype: _Optional[str] = ..., gemm: _Optional[str] = ..., kernels: _Optional[str] = ...) -> None: ...

class OperationStatus(_message.Message):
    __slots__ = ("operation_id", "kind", "state", "started_at", "ended_at", "error", "phase_seconds", "from_topology", "to_topology", "phase", "kv_bytes_moved", "weight_bytes_loaded", "num_requests_preempted", "built_groups", "lost_workers", "kv_dropped", "weight_bytes_resharded", "staging", "precopy", "kv_bytes_precopied")
    class PhaseSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PHASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FROM_TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    TO_TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    BUILT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    LOST_WORKERS_FIELD_NUMBER: _ClassVar[int]
    KV_DROPPED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_RESHARDED_FIELD_NUMBER: _ClassVar[int]
    STAGING_FIELD_NUMBER: _ClassVar[int]
    PRECOPY_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PRECOPIED_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    kind: str
    state: OperationState
    started_at: float
    ended_at: float
    error: str
    phase_seconds: _containers.ScalarMap[str, float]
    from_topology: str
    to_topology: str
    phase: str
    kv_bytes_moved: int
    weight_bytes_loaded: int
    num_requests_preempted: int
    built_groups: bool
    lost_workers: _containers.RepeatedScalarFieldContainer[str]
    kv_dropped: bool
    weight_bytes_resharded: int
    staging: str
    precopy: str
    kv_bytes_precopied: int
    def __init__(self, operation_id: _Optional[str] = ..., kind: _Optional[str] = ..., state: _Optional[_Union[OperationState, str]] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., error: _Optional[str] = ..., phase_seconds: _Optional[_Mapping[str, float]] = ..., from_topology: _Optional[str] = ..., to_topology: _Optional[str] = ..., phase: _Optional[str] = ..., kv_bytes_moved: _Optional[int] = ..., weight_bytes_loaded: _Optional[int] = ..., num_requests_preempted: _Optional[int] = ..., built_groups: _Optional[bool] = ..., lost_workers: _Optional[_Iterable[str]] = ..., kv_dropped: _Optional[bool] = ..., weight_bytes_resharded: _Optional[int] = ..., staging: _Optional[str] = ..., precopy: _Optional[str] = ..., kv_bytes_precopied: _Optional[int] = ...) -> None: ...

class StackStatus(_message.Message):
    __slots__ = ("topology", "state", "reason", "model", "workers", "router_address", "router", "last_operation", "updated_at", "lost_workers", "layouts")
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    LAST_OPERATION_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    LOST_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    topology: str
    state: StackState
    reason: str
    model: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    router_address: str
    router: _router_pb2.RouterStats
    last_operation: OperationStatus
    updated_at: float
    lost_workers: _containers.RepeatedScalarFieldContainer[str]
    layouts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, topology: _Optional[str] = ..., state: _Optional[_Union[StackState, str]] = ..., reason: _Optional[str] = ..., model: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., router_address: _Optional[str] = ..., router: _Optional[_Union[_router_pb2.RouterStats, _Mapping]] = ..., last_operation: _Optional[_Union[OperationStatus, _Mapping]] = ..., updated_at: _Optional[float] = ..., lost_workers: _Optional[_Iterable[str]] = ..., layouts: _Optional[_Iterable[str]] = ...) -> None: ...
