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
    __slots__ = ("rank", "state_before", "state_after", "kv_bytes_in", "kv_bytes_local", "weight_bytes_load", "weight_bytes_keep", "peak_extra_bytes", "num_kv_blocks_after", "weight_bytes_reshard")
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
    def __init__(self, rank: _Optional[int] = ..., state_before: _Optional[str] = ..., state_after: _Optional[str] = ..., kv_bytes_in: _Optional[int] = ..., kv_bytes_local: _Optional[int] = ..., weight_bytes_load: _Optional[int] = ..., weight_bytes_keep: _Optional[int] = ..., peak_extra_bytes: _Optional[int] = ..., num_kv_blocks_after: _Optional[int] = ..., weight_bytes_reshard: _Optional[int] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("from_topology", "to_topology", "workers", "num_used_blocks", "num_kv_blocks_after", "num_requests_preempted", "fits", "is_candidate", "stages", "staging_note")
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
    def __init__(self, from_topology: _Optional[str] = ..., to_topology: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerPlan, _Mapping]]] = ..., num_used_blocks: _Optional[int] = ..., num_kv_blocks_after: _Optional[int] = ..., num_requests_preempted: _Optional[int] = ..., fits: _Optional[bool] = ..., is_candidate: _Optional[bool] = ..., stages: _Optional[bool] = ..., staging_note: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchStatusRequest(_message.Message):
    __slots__ = ("interval_seconds",)
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    interval_seconds: float
    def __init__(self, interval_seconds: _Optional[float] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("rank", "pid", "state", "device", "address", "pp_rank", "tp_rank", "layer_start", "layer_end", "kv_head_start", "kv_head_end", "num_kv_blocks_used", "num_kv_blocks_total", "param_bytes", "kv_cache_bytes", "error")
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
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., device: _Optional[str] = ..., address: _Optional[str] = ..., pp_rank: _Optional[int] = ..., tp_rank: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., kv_head_end: _Optional[int] = ..., num_kv_blocks_used: _Optional[int] = ..., num_kv_blocks_total: _Optional[int] = ..., param_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("topology", "state", "reason", "model", "workers", "router_address", "router", "last_operation", "updated_at", "lost_workers")
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
    def __init__(self, topology: _Optional[str] = ..., state: _Optional[_Union[StackState, str]] = ..., reason: _Optional[str] = ..., model: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., router_address: _Optional[str] = ..., router: _Optional[_Union[_router_pb2.RouterStats, _Mapping]] = ..., last_operation: _Optional[_Union[OperationStatus, _Mapping]] = ..., updated_at: _Optional[float] = ..., lost_workers: _Optional[_Iterable[str]] = ...) -> None: ...
