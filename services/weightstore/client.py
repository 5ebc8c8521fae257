"""What workers use: fetch the manifest over gRPC and map tensors straight out of shared memory."""

from __future__ import annotations

import asyncio
import time
import zlib

import grpc
import torch

from services.rpc.reconfig.v1 import weightstore_pb2, weightstore_pb2_grpc
from services.rpc.tls import TLSConfig, aio_channel
from services.weightstore.manifest import Manifest, TensorEntry
from services.weightstore.shm import ShmSegment

# A large MoE manifest (tens of thousands of tensors) exceeds gRPC's default 4 MiB receive limit.
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
_RETRY_SECONDS = 0.1

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}


def channel_options() -> list[tuple[str, int]]:
    """gRPC channel options that admit a large manifest."""
    return [("grpc.max_receive_message_length", MAX_MANIFEST_BYTES)]


async def fetch_manifest(address: str, timeout: float = 10.0, tls: TLSConfig | None = None) -> Manifest:
    """Fetch the manifest from the store at `address` ("host:port").

    Waits, within `timeout` seconds, for a store that is still starting or loading (UNAVAILABLE).
    """
    deadline = time.monotonic() + timeout
    async with aio_channel(address, tls, channel_options()) as channel:
        stub = weightstore_pb2_grpc.WeightStoreStub(channel)
        while True:
            remaining = deadline - time.monotonic()
            try:
                response = await stub.GetManifest(
                    weightstore_pb2.GetManifestRequest(), timeout=max(remaining, 0.0), wait_for_ready=True
                )
                return Manifest.from_pb(response)
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or remaining <= _RETRY_SECONDS:
                    raise
            await asyncio.sleep(_RETRY_SECONDS)


class MappedCheckpoint:
    """Read-only access to the store's segments; tensor(name) is a zero-copy view into shared memory.

    A view stays backed by the shared segment: it costs this process no private memory, and the
    mapping outlives close() until the last view is gone. Copy what you keep (`.clone()`, `.to(device)`)
    so the process's resident weights are only its shard. Segments are opened read-only and mapped
    copy-on-write: an in-place write to a view changes only this process's pages, never the store.
    """

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._segments: dict[str, ShmSegment] = {}  # attached lazily, on first use

    def tensor(self, name: str) -> torch.Tensor:
        """Zero-copy CPU tensor of `name` with its checkpoint dtype and shape."""
        entry = self._entry(name)
        dtype = TORCH_DTYPES[entry.dtype]
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=dtype)  # torch.frombuffer rejects empty buffers
        # A memoryview slice (not the mmap itself): the tensor keeps it alive, and so the mapping.
        view = self._segment(entry.segment).buffer[entry.offset : entry.offset + entry.nbytes]
        return torch.frombuffer(view, dtype=dtype).view(entry.shape)

    def verify(self, name: str) -> bool:
        """True if the mapped bytes of `name` match the manifest's crc32."""
        entry = self._entry(name)
        buffer = self._segment(entry.segment).buffer
        with buffer[entry.offset : entry.offset + entry.nbytes] as view:
            return zlib.crc32(view) == entry.crc32

    def close(self) -> None:
        """Unmap every attached segment (a segment with live views unmaps when they are gone)."""
        for segment in self._segments.values():
            segment.close()
        self._segments.clear()

    def __enter__(self) -> MappedCheckpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _entry(self, name: str) -> TensorEntry:
        try:
            return self.manifest.tensors[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the checkpoint") from None

    def _segment(self, name: str) -> ShmSegment:
        segment = self._segments.get(name)
        if segment is None:
            segment = ShmSegment.attach(name, readonly=True, copy_on_write=True)
            expected = next(info.size for info in self.manifest.segments if info.name == name)
            if segment.size < expected:
                segment.close()
                raise ValueError(f"segment {name} is {segment.size} bytes, manifest says {expected}")
            self._segments[name] = segment
        return segment
