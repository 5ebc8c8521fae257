from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVSource(_message.Message):
    __slots__ = ("topology", "layer_partition", "pools", "block_size", "hostname")
    class PoolsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: PeerPool
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[PeerPool, _Mapping]] = ...) -> None: ...
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    LAYER_PARTITION_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    topology: str
    layer_partition: _containers.RepeatedScalarFieldContainer[int]
    pools: _containers.MessageMap[int, PeerPool]
    block_size: int
    hostname: str
    def __init__(self, topology: _Optional[str] = ..., layer_partition: _Optional[_Iterable[int]] = ..., pools: _Optional[_Mapping[int, PeerPool]] = ..., block_size: _Optional[int] = ..., hostname: _Optional[str] = ...) -> None: ...

class ImportKVRequest(_message.Message):
    __slots__ = ("source", "src_block_ids", "dst_block_ids")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    source: KVSource
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, source: _Optional[_Union[KVSource, _Mapping]] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., dst_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ImportKVResponse(_message.Message):
    __slots__ = ("kv_bytes_received", "seconds")
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    kv_bytes_received: int
    seconds: float
    def __init__(self, kv_bytes_received: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class KVSlice(_message.Message):
    __slots__ = ("layer", "head_offset", "num_heads")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HEAD_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    head_offset: int
    num_heads: int
    def __init__(self, layer: _Optional[int] = ..., head_offset: _Optional[int] = ..., num_heads: _Optional[int] = ...) -> None: ...

class ExportKVRequest(_message.Message):
    __slots__ = ("store_address", "group_key", "block_ids", "slices", "timeout_seconds")
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    store_address: str
    group_key: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    slices: _containers.RepeatedCompositeFieldContainer[KVSlice]
    timeout_seconds: float
    def __init__(self, store_address: _Optional[str] = ..., group_key: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., slices: _Optional[_Iterable[_Union[KVSlice, _Mapping]]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class ExportKVResponse(_message.Message):
    __slots__ = ("kv_bytes_sent", "seconds")
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    kv_bytes_sent: int
    seconds: float
    def __init__(self, kv_bytes_sent: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class GetExpertLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LayerExperts(_message.Message):
    __slots__ = ("layer", "phy2log", "load")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    layer: int
    phy2log: _containers.RepeatedScalarFieldContainer[int]
    load: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., phy2log: _Optional[_Iterable[int]] = ..., load: _Optional[_Iterable[int]] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("rank", "pp_rank", "ep_rank", "ep_size", "num_steps", "epoch", "layers")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    EP_RANK_FIELD_NUMBER: _ClassVar[int]
    EP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pp_rank: int
    ep_rank: int
    ep_size: int
    num_steps: int
    epoch: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerExperts]
    def __init__(self, rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., ep_rank: _Optional[int] = ..., ep_size: _Optional[int] = ..., num_steps: _Optional[int] = ..., epoch: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerExperts, _Mapping]]] = ...) -> None: ...

class PrepareExpertMapRequest(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class PrepareExpertMapResponse(_message.Message):
    __slots__ = ("layers", "bytes_received", "slots_changed", "seconds")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_CHANGED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerExperts]
    bytes_received: int
    slots_changed: int
    seconds: float
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerExperts, _Mapping]]] = ..., bytes_received: _Optional[int] = ..., slots_changed: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class AbortExpertMapRequest(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class AbortExpertMapResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegroupRequest(_message.Message):
    __slots__ = ("generation", "rank", "world_size", "topology", "layer_partition", "operation_id")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    LAYER_PARTITION_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    generation: int
    rank: int
    world_size: int
    topology: str
    layer_partition: _containers.RepeatedScalarFieldContainer[int]
    operation_id: str
    def __init__(self, generation: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., topology: _Optional[str] = ..., layer_partition: _Optional[_Iterable[int]] = ..., operation_id: _Optional[str] = ...) -> None: ...

class RegroupResponse(_message.Message):
    __slots__ = ("previous_rank", "kv_intact", "info")
    PREVIOUS_RANK_FIELD_NUMBER: _ClassVar[int]
    KV_INTACT_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    previous_rank: int
    kv_intact: bool
    info: WorkerInfo
    def __init__(self, previous_rank: _Optional[int] = ..., kv_intact: _Optional[bool] = ..., info: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...

class PrepareSwitchRequest(_message.Message):
    __slots__ = ("topology", "layer_partition", "export_cuda_ipc")
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    LAYER_PARTITION_FIELD_NUMBER: _ClassVar[int]
    EXPORT_CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    topology: str
    layer_partition: _containers.RepeatedScalarFieldContainer[int]
    export_cuda_ipc: bool
    def __init__(self, topology: _Optional[str] = ..., layer_partition: _Optional[_Iterable[int]] = ..., export_cuda_ipc: _Optional[bool] = ...) -> None: ...

class StageSwitchRequest(_message.Message):
    __slots__ = ("operation_id", "topology", "layer_partition", "duty")
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    LAYER_PARTITION_FIELD_NUMBER: _ClassVar[int]
    DUTY_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    topology: str
    layer_partition: _containers.RepeatedScalarFieldContainer[int]
    duty: float
    def __init__(self, operation_id: _Optional[str] = ..., topology: _Optional[str] = ..., layer_partition: _Optional[_Iterable[int]] = ..., duty: _Optional[float] = ...) -> None: ...

class PreCopyKVRequest(_message.Message):
    __slots__ = ("operation_id", "num_kv_blocks", "block_maps", "peers", "warm_block_maps", "duty")
    class PeersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: PeerPool
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[PeerPool, _Mapping]] = ...) -> None: ...
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_MAPS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    WARM_BLOCK_MAPS_FIELD_NUMBER: _ClassVar[int]
    DUTY_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    num_kv_blocks: int
    block_maps: _containers.RepeatedCompositeFieldContainer[BlockMap]
    peers: _containers.MessageMap[int, PeerPool]
    warm_block_maps: _containers.RepeatedCompositeFieldContainer[BlockMap]
    duty: float
    def __init__(self, operation_id: _Optional[str] = ..., num_kv_blocks: _Optional[int] = ..., block_maps: _Optional[_Iterable[_Union[BlockMap, _Mapping]]] = ..., peers: _Optional[_Mapping[int, PeerPool]] = ..., warm_block_maps: _Optional[_Iterable[_Union[BlockMap, _Mapping]]] = ..., duty: _Optional[float] = ...) -> None: ...

class PreCopyKVResponse(_message.Message):
    __slots__ = ("supported", "kv_bytes_received", "kv_bytes_local", "seconds", "staged_pool_bytes")
    SUPPORTED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_LOCAL_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    STAGED_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    supported: bool
    kv_bytes_received: int
    kv_bytes_local: int
    seconds: float
    staged_pool_bytes: int
    def __init__(self, supported: _Optional[bool] = ..., kv_bytes_received: _Optional[int] = ..., kv_bytes_local: _Optional[int] = ..., seconds: _Optional[float] = ..., staged_pool_bytes: _Optional[int] = ...) -> None: ...

class StageSwitchResponse(_message.Message):
    __slots__ = ("staged", "seconds", "weight_bytes_loaded", "weight_bytes_reused", "rested_seconds")
    STAGED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_REUSED_FIELD_NUMBER: _ClassVar[int]
    RESTED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    staged: bool
    seconds: float
    weight_bytes_loaded: int
    weight_bytes_reused: int
    rested_seconds: float
    def __init__(self, staged: _Optional[bool] = ..., seconds: _Optional[float] = ..., weight_bytes_loaded: _Optional[int] = ..., weight_bytes_reused: _Optional[int] = ..., rested_seconds: _Optional[float] = ...) -> None: ...

class PrepareSwitchResponse(_message.Message):
    __slots__ = ("num_kv_blocks", "kv_segments", "is_candidate", "block_size", "kv_dtype_bytes", "num_kv_blocks_now", "kv_cuda_ipc", "hostname", "cuda_ipc", "shm_domain")
    class KvSegmentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    class KvCudaIpcEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: bytes
        def __init__(self, key: _Optional[int] = ..., value: _Optional[bytes] = ...) -> None: ...
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    IS_CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_NOW_FIELD_NUMBER: _ClassVar[int]
    KV_CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    SHM_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    num_kv_blocks: int
    kv_segments: _containers.ScalarMap[int, str]
    is_candidate: bool
    block_size: int
    kv_dtype_bytes: int
    num_kv_blocks_now: int
    kv_cuda_ipc: _containers.ScalarMap[int, bytes]
    hostname: str
    cuda_ipc: bool
    shm_domain: str
    def __init__(self, num_kv_blocks: _Optional[int] = ..., kv_segments: _Optional[_Mapping[int, str]] = ..., is_candidate: _Optional[bool] = ..., block_size: _Optional[int] = ..., kv_dtype_bytes: _Optional[int] = ..., num_kv_blocks_now: _Optional[int] = ..., kv_cuda_ipc: _Optional[_Mapping[int, bytes]] = ..., hostname: _Optional[str] = ..., cuda_ipc: _Optional[bool] = ..., shm_domain: _Optional[str] = ...) -> None: ...

class PeerPool(_message.Message):
    __slots__ = ("kv_segments", "kv_cuda_ipc", "hostname", "cuda_ipc", "shm_domain", "address")
    class KvSegmentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    class KvCudaIpcEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: bytes
        def __init__(self, key: _Optional[int] = ..., value: _Optional[bytes] = ...) -> None: ...
    KV_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    KV_CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    SHM_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    kv_segments: _containers.ScalarMap[int, str]
    kv_cuda_ipc: _containers.ScalarMap[int, bytes]
    hostname: str
    cuda_ipc: bool
    shm_domain: str
    address: str
    def __init__(self, kv_segments: _Optional[_Mapping[int, str]] = ..., kv_cuda_ipc: _Optional[_Mapping[int, bytes]] = ..., hostname: _Optional[str] = ..., cuda_ipc: _Optional[bool] = ..., shm_domain: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class ApplySwitchRequest(_message.Message):
    __slots__ = ("operation_id", "topology", "layer_partition", "num_kv_blocks", "used_block_ids", "peers", "kv_channel", "old_ranks", "drop_kv", "block_maps", "precopied")
    class PeersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: PeerPool
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[PeerPool, _Mapping]] = ...) -> None: ...
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    LAYER_PARTITION_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    KV_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    OLD_RANKS_FIELD_NUMBER: _ClassVar[int]
    DROP_KV_FIELD_NUMBER: _ClassVar[int]
    BLOCK_MAPS_FIELD_NUMBER: _ClassVar[int]
    PRECOPIED_FIELD_NUMBER: _ClassVar[int]
    operation_id: str
    topology: str
    layer_partition: _containers.RepeatedScalarFieldContainer[int]
    num_kv_blocks: int
    used_block_ids: _containers.RepeatedScalarFieldContainer[int]
    peers: _containers.MessageMap[int, PeerPool]
    kv_channel: str
    old_ranks: _containers.RepeatedScalarFieldContainer[int]
    drop_kv: bool
    block_maps: _containers.RepeatedCompositeFieldContainer[BlockMap]
    precopied: bool
    def __init__(self, operation_id: _Optional[str] = ..., topology: _Optional[str] = ..., layer_partition: _Optional[_Iterable[int]] = ..., num_kv_blocks: _Optional[int] = ..., used_block_ids: _Optional[_Iterable[int]] = ..., peers: _Optional[_Mapping[int, PeerPool]] = ..., kv_channel: _Optional[str] = ..., old_ranks: _Optional[_Iterable[int]] = ..., drop_kv: _Optional[bool] = ..., block_maps: _Optional[_Iterable[_Union[BlockMap, _Mapping]]] = ..., precopied: _Optional[bool] = ...) -> None: ...

class BlockMap(_message.Message):
    __slots__ = ("src_pool", "dst_pool", "src_block_ids", "dst_block_ids")
    SRC_POOL_FIELD_NUMBER: _ClassVar[int]
    DST_POOL_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    src_pool: int
    dst_pool: int
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, src_pool: _Optional[int] = ..., dst_pool: _Optional[int] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., dst_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ApplySwitchResponse(_message.Message):
    __slots__ = ("kv_bytes_received", "kv_bytes_local", "weight_bytes_loaded", "weight_bytes_reused", "migrate_seconds", "reload_seconds", "peak_extra_bytes", "built_groups", "info", "apply_seconds", "weight_bytes_resharded", "used_staged", "used_precopy", "used_staged_runner", "staged_graphs", "expert_peak_extra_bytes")
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_LOCAL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_REUSED_FIELD_NUMBER: _ClassVar[int]
    MIGRATE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RELOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PEAK_EXTRA_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUILT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_RESHARDED_FIELD_NUMBER: _ClassVar[int]
    USED_STAGED_FIELD_NUMBER: _ClassVar[int]
    USED_PRECOPY_FIELD_NUMBER: _ClassVar[int]
    USED_STAGED_RUNNER_FIELD_NUMBER: _ClassVar[int]
    STAGED_GRAPHS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_PEAK_EXTRA_BYTES_FIELD_NUMBER: _ClassVar[int]
    kv_bytes_received: int
    kv_bytes_local: int
    weight_bytes_loaded: int
    weight_bytes_reused: int
    migrate_seconds: float
    reload_seconds: float
    peak_extra_bytes: int
    built_groups: bool
    info: WorkerInfo
    apply_seconds: float
    weight_bytes_resharded: int
    used_staged: bool
    used_precopy: bool
    used_staged_runner: bool
    staged_graphs: int
    expert_peak_extra_bytes: int
    def __init__(self, kv_bytes_received: _Optional[int] = ..., kv_bytes_local: _Optional[int] = ..., weight_bytes_loaded: _Optional[int] = ..., weight_bytes_reused: _Optional[int] = ..., migrate_seconds: _Optional[float] = ..., reload_seconds: _Optional[float] = ..., peak_extra_bytes: _Optional[int] = ..., built_groups: _Optional[bool] = ..., info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., apply_seconds: _Optional[float] = ..., weight_bytes_resharded: _Optional[int] = ..., used_staged: _Optional[bool] = ..., used_precopy: _Optional[bool] = ..., used_staged_runner: _Optional[bool] = ..., staged_graphs: _Optional[int] = ..., expert_peak_extra_bytes: _Optional[int] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "num_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    num_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., num_logprobs: _Optional[int] = ...) -> None: ...

class SequenceStep(_message.Message):
    __slots__ = ("request_id", "token_ids", "start_position", "block_table", "sampling", "sample", "return_logits", "num_generated", "output_token_ids", "output_token_counts", "distinct_prompt_token_ids", "suppressed_token_ids", "prompt_logprob_token_ids", "dp_rank")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    DISTINCT_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SUPPRESSED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_position: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    sample: bool
    return_logits: bool
    num_generated: int
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_counts: _containers.RepeatedScalarFieldContainer[int]
    distinct_prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    suppressed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprob_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dp_rank: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., start_position: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., sample: _Optional[bool] = ..., return_logits: _Optional[bool] = ..., num_generated: _Optional[int] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., output_token_counts: _Optional[_Iterable[int]] = ..., distinct_prompt_token_ids: _Optional[_Iterable[int]] = ..., suppressed_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprob_token_ids: _Optional[_Iterable[int]] = ..., dp_rank: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "sequences", "commit_expert_map", "rows")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    COMMIT_EXPERT_MAP_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceStep]
    commit_expert_map: int
    rows: StepRows
    def __init__(self, step_id: _Optional[int] = ..., sequences: _Optional[_Iterable[_Union[SequenceStep, _Mapping]]] = ..., commit_expert_map: _Optional[int] = ..., rows: _Optional[_Union[StepRows, _Mapping]] = ...) -> None: ...

class StepRows(_message.Message):
    __slots__ = ("epoch", "slots", "kinds", "positions", "tokens", "new_blocks", "freed")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREED_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    slots: bytes
    kinds: bytes
    positions: bytes
    tokens: bytes
    new_blocks: bytes
    freed: bytes
    def __init__(self, epoch: _Optional[int] = ..., slots: _Optional[bytes] = ..., kinds: _Optional[bytes] = ..., positions: _Optional[bytes] = ..., tokens: _Optional[bytes] = ..., new_blocks: _Optional[bytes] = ..., freed: _Optional[bytes] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SequenceResult(_message.Message):
    __slots__ = ("request_id", "token_id", "logits", "sampled_logprob", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_id: int
    logits: bytes
    sampled_logprob: TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_id: _Optional[int] = ..., logits: _Optional[bytes] = ..., sampled_logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "rank", "results", "error", "compute_seconds", "forward_seconds", "head_seconds", "tokens")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    rank: int
    results: _containers.RepeatedCompositeFieldContainer[SequenceResult]
    error: str
    compute_seconds: float
    forward_seconds: float
    head_seconds: float
    tokens: bytes
    def __init__(self, step_id: _Optional[int] = ..., rank: _Optional[int] = ..., results: _Optional[_Iterable[_Union[SequenceResult, _Mapping]]] = ..., error: _Optional[str] = ..., compute_seconds: _Optional[float] = ..., forward_seconds: _Optional[float] = ..., head_seconds: _Optional[float] = ..., tokens: _Optional[bytes] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("rank", "world_size", "pid", "topology", "pp_rank", "tp_rank", "layer_start", "layer_end", "kv_head_start", "kv_head_end", "num_kv_blocks", "block_size", "kv_cache_bytes", "param_bytes", "device", "candidate_topologies", "rss_bytes", "state", "generation", "num_threads", "ep_rank", "ep_size", "expert_slot_start", "expert_slot_end", "step_port", "numerics", "dtype", "gemm", "kernels")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_END_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_TOPOLOGIES_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    EP_RANK_FIELD_NUMBER: _ClassVar[int]
    EP_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXPERT_SLOT_START_FIELD_NUMBER: _ClassVar[int]
    EXPERT_SLOT_END_FIELD_NUMBER: _ClassVar[int]
    STEP_PORT_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    GEMM_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    pid: int
    topology: str
    pp_rank: int
    tp_rank: int
    layer_start: int
    layer_end: int
    kv_head_start: int
    kv_head_end: int
    num_kv_blocks: int
    block_size: int
    kv_cache_bytes: int
    param_bytes: int
    device: str
    candidate_topologies: _containers.RepeatedScalarFieldContainer[str]
    rss_bytes: int
    state: str
    generation: int
    num_threads: int
    ep_rank: int
    ep_size: int
    expert_slot_start: int
    expert_slot_end: int
    step_port: int
    numerics: str
    dtype: str
    gemm: str
    kernels: str
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., pid: _Optional[int] = ..., topology: _Optional[str] = ..., pp_rank: _Optional[int] = ..., tp_rank: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., kv_head_end: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., param_bytes: _Optional[int] = ..., device: _Optional[str] = ..., candidate_topologies: _Optional[_Iterable[str]] = ..., rss_bytes: _Optional[int] = ..., state: _Optional[str] = ..., generation: _Optional[int] = ..., num_threads: _Optional[int] = ..., ep_rank: _Optional[int] = ..., ep_size: _Optional[int] = ..., expert_slot_start: _Optional[int] = ..., expert_slot_end: _Optional[int] = ..., step_port: _Optional[int] = ..., numerics: _Optional[str] = ..., dtype: _Optional[str] = ..., gemm: _Optional[str] = ..., kernels: _Optional[str] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
