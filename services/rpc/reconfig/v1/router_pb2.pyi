from services.rpc.reconfig.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MigrateOutRequest(_message.Message):
    __slots__ = ("request_id", "action", "timeout_seconds")
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        EXPORT: _ClassVar[MigrateOutRequest.Action]
        STOP: _ClassVar[MigrateOutRequest.Action]
        COMMIT: _ClassVar[MigrateOutRequest.Action]
        ABORT: _ClassVar[MigrateOutRequest.Action]
    EXPORT: MigrateOutRequest.Action
    STOP: MigrateOutRequest.Action
    COMMIT: MigrateOutRequest.Action
    ABORT: MigrateOutRequest.Action
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    action: MigrateOutRequest.Action
    timeout_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., action: _Optional[_Union[MigrateOutRequest.Action, str]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class MigrateOutResponse(_message.Message):
    __slots__ = ("block_table", "num_computed_tokens", "output_token_ids", "source", "finished", "kv_epoch", "pool_epoch")
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    KV_EPOCH_FIELD_NUMBER: _ClassVar[int]
    POOL_EPOCH_FIELD_NUMBER: _ClassVar[int]
    block_table: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    source: _worker_pb2.KVSource
    finished: bool
    kv_epoch: int
    pool_epoch: int
    def __init__(self, block_table: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., source: _Optional[_Union[_worker_pb2.KVSource, _Mapping]] = ..., finished: _Optional[bool] = ..., kv_epoch: _Optional[int] = ..., pool_epoch: _Optional[int] = ...) -> None: ...

class MigrateInRequest(_message.Message):
    __slots__ = ("request_id", "action", "num_tokens", "source", "src_block_ids", "dst_block_ids", "request")
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RESERVE: _ClassVar[MigrateInRequest.Action]
        PULL: _ClassVar[MigrateInRequest.Action]
        RELEASE: _ClassVar[MigrateInRequest.Action]
    RESERVE: MigrateInRequest.Action
    PULL: MigrateInRequest.Action
    RELEASE: MigrateInRequest.Action
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    action: MigrateInRequest.Action
    num_tokens: int
    source: _worker_pb2.KVSource
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    request: GenerateRequest
    def __init__(self, request_id: _Optional[str] = ..., action: _Optional[_Union[MigrateInRequest.Action, str]] = ..., num_tokens: _Optional[int] = ..., source: _Optional[_Union[_worker_pb2.KVSource, _Mapping]] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ...) -> None: ...

class MigrateInResponse(_message.Message):
    __slots__ = ("block_ids", "kv_bytes", "seconds")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    kv_bytes: int
    seconds: float
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., kv_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class MigratedState(_message.Message):
    __slots__ = ("output_token_ids", "num_computed_tokens")
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    def __init__(self, output_token_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ...) -> None: ...

class ExpertStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LayerBalance(_message.Message):
    __slots__ = ("layer", "phy2log", "load", "rank_load", "balancedness")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    RANK_LOAD_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    phy2log: _containers.RepeatedScalarFieldContainer[int]
    load: _containers.RepeatedScalarFieldContainer[int]
    rank_load: _containers.RepeatedScalarFieldContainer[int]
    balancedness: float
    def __init__(self, layer: _Optional[int] = ..., phy2log: _Optional[_Iterable[int]] = ..., load: _Optional[_Iterable[int]] = ..., rank_load: _Optional[_Iterable[int]] = ..., balancedness: _Optional[float] = ...) -> None: ...

class ExpertStatusResponse(_message.Message):
    __slots__ = ("expert_parallel", "ep_size", "num_physical_experts", "balancedness", "layers", "epoch", "window_steps", "eplb_enabled", "step_interval", "num_rebalances")
    EXPERT_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    EP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PHYSICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    EPLB_ENABLED_FIELD_NUMBER: _ClassVar[int]
    STEP_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    NUM_REBALANCES_FIELD_NUMBER: _ClassVar[int]
    expert_parallel: bool
    ep_size: int
    num_physical_experts: int
    balancedness: float
    layers: _containers.RepeatedCompositeFieldContainer[LayerBalance]
    epoch: int
    window_steps: int
    eplb_enabled: bool
    step_interval: int
    num_rebalances: int
    def __init__(self, expert_parallel: _Optional[bool] = ..., ep_size: _Optional[int] = ..., num_physical_experts: _Optional[int] = ..., balancedness: _Optional[float] = ..., layers: _Optional[_Iterable[_Union[LayerBalance, _Mapping]]] = ..., epoch: _Optional[int] = ..., window_steps: _Optional[int] = ..., eplb_enabled: _Optional[bool] = ..., step_interval: _Optional[int] = ..., num_rebalances: _Optional[int] = ...) -> None: ...

class RebalanceExpertsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RebalanceExpertsResponse(_message.Message):
    __slots__ = ("epoch", "balancedness_before", "balancedness_after", "bytes_moved", "slots_changed", "prepare_seconds", "commit_seconds")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_AFTER_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_CHANGED_FIELD_NUMBER: _ClassVar[int]
    PREPARE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    balancedness_before: float
    balancedness_after: float
    bytes_moved: int
    slots_changed: int
    prepare_seconds: float
    commit_seconds: float
    def __init__(self, epoch: _Optional[int] = ..., balancedness_before: _Optional[float] = ..., balancedness_after: _Optional[float] = ..., bytes_moved: _Optional[int] = ..., slots_changed: _Optional[int] = ..., prepare_seconds: _Optional[float] = ..., commit_seconds: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "prompt", "sampling", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "migrated", "min_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt: str
    sampling: _worker_pb2.SamplingParams
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    migrated: MigratedState
    min_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt: _Optional[str] = ..., sampling: _Optional[_Union[_worker_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., migrated: _Optional[_Union[MigratedState, _Mapping]] = ..., min_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "error", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    error: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_worker_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_worker_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class FreezeRequest(_message.Message):
    __slots__ = ("timeout_seconds", "lease_seconds")
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    timeout_seconds: float
    lease_seconds: float
    def __init__(self, timeout_seconds: _Optional[float] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class FreezeResponse(_message.Message):
    __slots__ = ("stats", "drain_seconds")
    STATS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    stats: RouterStats
    drain_seconds: float
    def __init__(self, stats: _Optional[_Union[RouterStats, _Mapping]] = ..., drain_seconds: _Optional[float] = ...) -> None: ...

class RebindRequest(_message.Message):
    __slots__ = ("num_kv_blocks", "worker_addresses", "drop_kv", "dp_size", "precopy_operation_id", "resume", "switch", "worker_infos")
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    DROP_KV_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PRECOPY_OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    SWITCH_FIELD_NUMBER: _ClassVar[int]
    WORKER_INFOS_FIELD_NUMBER: _ClassVar[int]
    num_kv_blocks: int
    worker_addresses: _containers.RepeatedScalarFieldContainer[str]
    drop_kv: bool
    dp_size: int
    precopy_operation_id: str
    resume: bool
    switch: SwitchReport
    worker_infos: _containers.RepeatedCompositeFieldContainer[_worker_pb2.WorkerInfo]
    def __init__(self, num_kv_blocks: _Optional[int] = ..., worker_addresses: _Optional[_Iterable[str]] = ..., drop_kv: _Optional[bool] = ..., dp_size: _Optional[int] = ..., precopy_operation_id: _Optional[str] = ..., resume: _Optional[bool] = ..., switch: _Optional[_Union[SwitchReport, _Mapping]] = ..., worker_infos: _Optional[_Iterable[_Union[_worker_pb2.WorkerInfo, _Mapping]]] = ...) -> None: ...

class PreCopyBlocksRequest(_message.Message):
    __slots__ = ("operation_id", "num_kv_blocks", "dp_size")
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    num_kv_blocks: int
    dp_size: int
    def __init__(self, operation_id: _Optional[str] = ..., num_kv_blocks: _Optional[int] = ..., dp_size: _Optional[int] = ...) -> None: ...

class PreCopyBlocksResponse(_message.Message):
    __slots__ = ("block_maps", "num_precopied", "num_used", "warm_block_maps")
    BLOCK_MAPS_FIELD_NUMBER: _ClassVar[int]
    NUM_PRECOPIED_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_FIELD_NUMBER: _ClassVar[int]
    WARM_BLOCK_MAPS_FIELD_NUMBER: _ClassVar[int]
    block_maps: _containers.RepeatedCompositeFieldContainer[_worker_pb2.BlockMap]
    num_precopied: int
    num_used: int
    warm_block_maps: _containers.RepeatedCompositeFieldContainer[_worker_pb2.BlockMap]
    def __init__(self, block_maps: _Optional[_Iterable[_Union[_worker_pb2.BlockMap, _Mapping]]] = ..., num_precopied: _Optional[int] = ..., num_used: _Optional[int] = ..., warm_block_maps: _Optional[_Iterable[_Union[_worker_pb2.BlockMap, _Mapping]]] = ...) -> None: ...

class PlanRebindRequest(_message.Message):
    __slots__ = ("num_kv_blocks", "dp_size")
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_kv_blocks: int
    dp_size: int
    def __init__(self, num_kv_blocks: _Optional[int] = ..., dp_size: _Optional[int] = ...) -> None: ...

class RequestPlacement(_message.Message):
    __slots__ = ("request_id", "src_pool", "dst_pool", "num_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_POOL_FIELD_NUMBER: _ClassVar[int]
    DST_POOL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    src_pool: int
    dst_pool: int
    num_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., src_pool: _Optional[int] = ..., dst_pool: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class PlanRebindResponse(_message.Message):
    __slots__ = ("placements",)
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    placements: _containers.RepeatedCompositeFieldContainer[RequestPlacement]
    def __init__(self, placements: _Optional[_Iterable[_Union[RequestPlacement, _Mapping]]] = ...) -> None: ...

class RebindResponse(_message.Message):
    __slots__ = ("stats", "used_block_ids", "block_maps")
    STATS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_MAPS_FIELD_NUMBER: _ClassVar[int]
    stats: RouterStats
    used_block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_maps: _containers.RepeatedCompositeFieldContainer[_worker_pb2.BlockMap]
    def __init__(self, stats: _Optional[_Union[RouterStats, _Mapping]] = ..., used_block_ids: _Optional[_Iterable[int]] = ..., block_maps: _Optional[_Iterable[_Union[_worker_pb2.BlockMap, _Mapping]]] = ...) -> None: ...

class SwitchReport(_message.Message):
    __slots__ = ("operation_id", "from_topology", "to_topology", "phase_seconds", "kv_bytes_moved", "weight_bytes_loaded", "num_requests_preempted", "state", "kv_bytes_precopied")
    class PhaseSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    TO_TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    PHASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PRECOPIED_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    from_topology: str
    to_topology: str
    phase_seconds: _containers.ScalarMap[str, float]
    kv_bytes_moved: int
    weight_bytes_loaded: int
    num_requests_preempted: int
    state: str
    kv_bytes_precopied: int
    def __init__(self, operation_id: _Optional[str] = ..., from_topology: _Optional[str] = ..., to_topology: _Optional[str] = ..., phase_seconds: _Optional[_Mapping[str, float]] = ..., kv_bytes_moved: _Optional[int] = ..., weight_bytes_loaded: _Optional[int] = ..., num_requests_preempted: _Optional[int] = ..., state: _Optional[str] = ..., kv_bytes_precopied: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("switch",)
    SWITCH_FIELD_NUMBER: _ClassVar[int]
    switch: SwitchReport
    def __init__(self, switch: _Optional[_Union[SwitchReport, _Mapping]] = ...) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: RouterStats
    def __init__(self, stats: _Optional[_Union[RouterStats, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RouterStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_kv_blocks_total", "num_kv_blocks_used", "num_preemptions", "num_prompt_tokens", "num_generation_tokens", "topology", "is_frozen", "extra", "stalled", "num_kv_blocks_used_per_dp_rank", "window", "worker_time", "block_size", "max_model_len", "num_decodes_ahead")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    IS_FROZEN_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_USED_PER_DP_RANK_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    WORKER_TIME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODES_AHEAD_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    topology: str
    is_frozen: bool
    extra: _containers.ScalarMap[str, float]
    stalled: str
    num_kv_blocks_used_per_dp_rank: _containers.RepeatedScalarFieldContainer[int]
    window: LoadWindow
    worker_time: _containers.RepeatedCompositeFieldContainer[WorkerTime]
    block_size: int
    max_model_len: int
    num_decodes_ahead: int
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_kv_blocks_total: _Optional[int] = ..., num_kv_blocks_used: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_generation_tokens: _Optional[int] = ..., topology: _Optional[str] = ..., is_frozen: _Optional[bool] = ..., extra: _Optional[_Mapping[str, float]] = ..., stalled: _Optional[str] = ..., num_kv_blocks_used_per_dp_rank: _Optional[_Iterable[int]] = ..., window: _Optional[_Union[LoadWindow, _Mapping]] = ..., worker_time: _Optional[_Iterable[_Union[WorkerTime, _Mapping]]] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_decodes_ahead: _Optional[int] = ...) -> None: ...

class WorkerTime(_message.Message):
    __slots__ = ("rank", "forward_seconds", "head_seconds", "steps")
    RANK_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    forward_seconds: float
    head_seconds: float
    steps: int
    def __init__(self, rank: _Optional[int] = ..., forward_seconds: _Optional[float] = ..., head_seconds: _Optional[float] = ..., steps: _Optional[int] = ...) -> None: ...

class LoadWindow(_message.Message):
    __slots__ = ("window_seconds", "arrival_rate", "mean_prompt_tokens", "mean_output_tokens", "ttft_p50_seconds", "ttft_p99_seconds", "tpot_mean_seconds", "tpot_p99_seconds", "num_finished", "mean_context_tokens", "num_requests", "prompt_tokens_std", "output_tokens_std", "arrival_dispersion")
    WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MEAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TPOT_P99_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    MEAN_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_STD_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_STD_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_DISPERSION_FIELD_NUMBER: _ClassVar[int]
    window_seconds: float
    arrival_rate: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    ttft_p50_seconds: float
    ttft_p99_seconds: float
    tpot_mean_seconds: float
    tpot_p99_seconds: float
    num_finished: int
    mean_context_tokens: float
    num_requests: int
    prompt_tokens_std: float
    output_tokens_std: float
    arrival_dispersion: float
    def __init__(self, window_seconds: _Optional[float] = ..., arrival_rate: _Optional[float] = ..., mean_prompt_tokens: _Optional[float] = ..., mean_output_tokens: _Optional[float] = ..., ttft_p50_seconds: _Optional[float] = ..., ttft_p99_seconds: _Optional[float] = ..., tpot_mean_seconds: _Optional[float] = ..., tpot_p99_seconds: _Optional[float] = ..., num_finished: _Optional[int] = ..., mean_context_tokens: _Optional[float] = ..., num_requests: _Optional[int] = ..., prompt_tokens_std: _Optional[float] = ..., output_tokens_std: _Optional[float] = ..., arrival_dispersion: _Optional[float] = ...) -> None: ...
