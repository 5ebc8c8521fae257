from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetManifestRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape", "segment", "offset", "nbytes", "crc32")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    segment: str
    offset: int
    nbytes: int
    crc32: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., segment: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("name", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("model_dir", "config_json", "tensors", "segments", "total_bytes")
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    model_dir: str
    config_json: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    total_bytes: int
    def __init__(self, model_dir: _Optional[str] = ..., config_json: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ready", "pid")
    READY_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    pid: int
    def __init__(self, ready: _Optional[bool] = ..., pid: _Optional[int] = ...) -> None: ...
