from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StartInstanceRequest(_message.Message):
    __slots__ = ("topology",)
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    topology: str
    def __init__(self, topology: _Optional[str] = ...) -> None: ...

class StopInstanceRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class StopInstanceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AddInstanceRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class RemoveInstanceRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RemoveInstanceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InstanceStatus(_message.Message):
    __slots__ = ("name", "address", "topology", "state", "num_requests", "kv_tokens", "capacity_tokens", "slot")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    topology: str
    state: str
    num_requests: int
    kv_tokens: int
    capacity_tokens: int
    slot: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., topology: _Optional[str] = ..., state: _Optional[str] = ..., num_requests: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., capacity_tokens: _Optional[int] = ..., slot: _Optional[str] = ...) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances", "policy", "moves", "kv_bytes_moved", "time_average_instances", "num_replaced")
    class MovesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    TIME_AVERAGE_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLACED_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceStatus]
    policy: str
    moves: _containers.ScalarMap[str, int]
    kv_bytes_moved: int
    time_average_instances: float
    num_replaced: int
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceStatus, _Mapping]]] = ..., policy: _Optional[str] = ..., moves: _Optional[_Mapping[str, int]] = ..., kv_bytes_moved: _Optional[int] = ..., time_average_instances: _Optional[float] = ..., num_replaced: _Optional[int] = ...) -> None: ...

class DrainInstanceRequest(_message.Message):
    __slots__ = ("name", "drain")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    name: str
    drain: bool
    def __init__(self, name: _Optional[str] = ..., drain: _Optional[bool] = ...) -> None: ...

class DrainInstanceResponse(_message.Message):
    __slots__ = ("num_moved", "num_failed", "instance")
    NUM_MOVED_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    num_moved: int
    num_failed: int
    instance: InstanceStatus
    def __init__(self, num_moved: _Optional[int] = ..., num_failed: _Optional[int] = ..., instance: _Optional[_Union[InstanceStatus, _Mapping]] = ...) -> None: ...
