"""The weightstore's contract: where each checkpoint tensor lives in shared memory."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from services.rpc.reconfig.v1 import weightstore_pb2

# Tensor offsets inside a segment are multiples of this (cache line; enough for any dtype/SIMD load).
ALIGNMENT = 64

# safetensors dtype string -> bytes per element. Raw dtypes are kept: the store never converts.
DTYPE_NUM_BYTES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}


def align_up(num_bytes: int, alignment: int = ALIGNMENT) -> int:
    """Smallest multiple of `alignment` that is >= num_bytes."""
    return -(-num_bytes // alignment) * alignment


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One checkpoint tensor: dtype, shape and its bytes' place in a segment."""

    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]  # row-major
    segment: str
    offset: int  # bytes from the segment start; a multiple of ALIGNMENT
    nbytes: int
    crc32: int  # zlib.crc32 of the tensor bytes

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NUM_BYTES:
            raise ValueError(f"{self.name}: unknown dtype {self.dtype!r}")
        if any(dim < 0 for dim in self.shape):
            raise ValueError(f"{self.name}: negative dimension in shape {self.shape}")
        expected = math.prod(self.shape) * DTYPE_NUM_BYTES[self.dtype]
        if self.nbytes != expected:
            raise ValueError(f"{self.name}: nbytes {self.nbytes} != {expected} for {self.dtype}{list(self.shape)}")
        if self.offset < 0 or self.offset % ALIGNMENT:
            raise ValueError(f"{self.name}: offset {self.offset} is not a multiple of {ALIGNMENT}")

    def to_pb(self) -> weightstore_pb2.TensorEntry:
        """Protobuf form."""
        return weightstore_pb2.TensorEntry(
            name=self.name, dtype=self.dtype, shape=self.shape, segment=self.segment,
            offset=self.offset, nbytes=self.nbytes, crc32=self.crc32,
        )

    @classmethod
    def from_pb(cls, message: weightstore_pb2.TensorEntry) -> TensorEntry:
        """From the protobuf form."""
        return cls(
            name=message.name, dtype=message.dtype, shape=tuple(message.shape), segment=message.segment,
            offset=message.offset, nbytes=message.nbytes, crc32=message.crc32,
        )


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """A shared-memory segment owned by the store."""

    name: str
    size: int  # bytes

    def to_pb(self) -> weightstore_pb2.Segment:
        """Protobuf form."""
        return weightstore_pb2.Segment(name=self.name, size=self.size)

    @classmethod
    def from_pb(cls, message: weightstore_pb2.Segment) -> SegmentInfo:
        """From the protobuf form."""
        return cls(name=message.name, size=message.size)


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything a worker needs to map the checkpoint: config.json and every tensor's location."""

    model_dir: str
    config_json: str  # config.json, verbatim
    tensors: dict[str, TensorEntry]  # by name, in segment/offset order; treat as read-only
    segments: tuple[SegmentInfo, ...]
    total_bytes: int  # sum of tensor nbytes (segments are larger: alignment padding)

    def __post_init__(self) -> None:
        # A reader maps `offset:offset+nbytes` of a segment; reject a manifest that points outside.
        sizes = {segment.name: segment.size for segment in self.segments}
        if len(sizes) != len(self.segments):
            raise ValueError("duplicate segment names in manifest")
        for name, entry in self.tensors.items():
            if name != entry.name:
                raise ValueError(f"tensor key {name!r} != entry name {entry.name!r}")
            if entry.segment not in sizes:
                raise ValueError(f"{name}: unknown segment {entry.segment!r}")
            if entry.offset + entry.nbytes > sizes[entry.segment]:
                raise ValueError(f"{name}: bytes {entry.offset}+{entry.nbytes} exceed segment {entry.segment}")
        if self.total_bytes != sum(entry.nbytes for entry in self.tensors.values()):
            raise ValueError("total_bytes does not match the tensors")

    def to_pb(self) -> weightstore_pb2.Manifest:
        """Protobuf form."""
        return weightstore_pb2.Manifest(
            model_dir=self.model_dir,
            config_json=self.config_json,
            tensors=[entry.to_pb() for entry in self.tensors.values()],
            segments=[segment.to_pb() for segment in self.segments],
            total_bytes=self.total_bytes,
        )

    def content_digest(self) -> str:
        """A digest of what the store holds (config.json and every tensor's name, dtype, shape and CRC-32), not of
        where: two stores on two hosts that loaded the same checkpoint give the same digest."""
        digest = hashlib.sha256(self.config_json.encode())
        for name in sorted(self.tensors):
            entry = self.tensors[name]
            digest.update(f"\0{name}\0{entry.dtype}\0{tuple(entry.shape)}\0{entry.crc32}".encode())
        return digest.hexdigest()

    @classmethod
    def from_pb(cls, message: weightstore_pb2.Manifest) -> Manifest:
        """From the protobuf form; validates that every tensor lies inside its segment."""
        tensors = {}
        for entry_pb in message.tensors:
            if entry_pb.name in tensors:
                raise ValueError(f"duplicate tensor {entry_pb.name!r} in manifest")
            tensors[entry_pb.name] = TensorEntry.from_pb(entry_pb)
        return cls(
            model_dir=message.model_dir,
            config_json=message.config_json,
            tensors=tensors,
            segments=tuple(SegmentInfo.from_pb(segment) for segment in message.segments),
            total_bytes=message.total_bytes,
        )
