"""CUDA IPC views of a worker's GPU KV layers, so that a worker of another instance on the same host copies a
request's blocks straight out of them (live request migration between instances; on CPU the layers are shared
memory segments instead, kv_cache.py).

The exporting worker takes the layer's CUDA IPC handle once (torch's `_share_cuda_`: the handle of the allocation
the tensor lives in, and the tensor's offset inside it) and gives back torch's cross-process reference count at
once: the importer opens the handle for one pull and closes it (CuPy's runtime calls), so the exporter never waits
for it, and freeing the layer at a switch returns its memory to the allocator as usual. A pull that races such a
free reads reused memory, never unmapped memory; the move it serves is ended by that switch anyway (the source's
router cancels every move in progress), so those bytes are never used.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

_HEADER = struct.Struct("<iQQ")  # device ordinal, byte offset of the tensor in the allocation, its bytes
_HANDLE_BYTES = 64               # cudaIpcMemHandle_t


class IpcUnavailable(RuntimeError):
    """CUDA IPC cannot be used here (no CUDA, no CuPy, or the handle could not be opened)."""


@dataclass(frozen=True, slots=True)
class IpcHandle:
    device: int
    offset_bytes: int
    num_bytes: int
    handle: bytes

    def to_bytes(self) -> bytes:
        return _HEADER.pack(self.device, self.offset_bytes, self.num_bytes) + self.handle

    @classmethod
    def from_bytes(cls, data: bytes) -> IpcHandle:
        if len(data) != _HEADER.size + _HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle is {_HEADER.size + _HANDLE_BYTES} bytes, not {len(data)}")
        device, offset, num_bytes = _HEADER.unpack_from(data)
        return cls(device, offset, num_bytes, bytes(data[_HEADER.size:]))


def export_handle(tensor: torch.Tensor) -> bytes:
    """The IPC handle of a contiguous CUDA tensor, as IpcHandle bytes (for `opened` in another process)."""
    if tensor.device.type != "cuda" or not tensor.is_contiguous():
        raise ValueError("only a contiguous CUDA tensor has an IPC handle here")
    storage = tensor.untyped_storage()
    device, handle, _, storage_offset, ref_counter, ref_counter_offset, _, _ = storage._share_cuda_()
    # Nobody keeps a reference: the importer opens and closes the handle per pull (see the module's note).
    torch.UntypedStorage._release_ipc_counter_cuda(ref_counter, ref_counter_offset)
    offset = storage_offset + tensor.storage_offset() * tensor.element_size()
    return IpcHandle(device, offset, tensor.numel() * tensor.element_size(), raw_handle(bytes(handle))).to_bytes()


def raw_handle(handle: bytes) -> bytes:
    """The cudaIpcMemHandle_t in torch's shareable handle: torch writes [version][type][handle] (type 'c': a
    cudaMalloc block); an older torch wrote the bare handle. IpcUnavailable for an expandable segment's handle
    (PYTORCH_CUDA_ALLOC_CONF=expandable_segments), which is not a cudaIpcMemHandle_t."""
    if len(handle) == _HANDLE_BYTES:
        return handle
    if len(handle) == _HANDLE_BYTES + 2 and handle[1] == ord("c"):
        return handle[2:]
    raise IpcUnavailable(f"torch's IPC handle of {len(handle)} bytes (type {handle[1:2]!r}) is not a cudaMalloc "
                         "block's: expandable segments cannot be read by another instance here")


def preload_cuda_ipc() -> bool:
    """Import CuPy now (about half a second), so that the first import of KV from another instance does not wait
    for it; False where it is not installed (imports onto this worker are then refused)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


class OpenedHandle:
    """Another process's GPU tensor mapped into this one (a flat tensor of `dtype`); close() unmaps it."""

    def __init__(self, data: bytes, dtype: torch.dtype, device: torch.device) -> None:
        handle = IpcHandle.from_bytes(data)
        try:
            import cupy
        except ImportError as exc:
            raise IpcUnavailable("reading another process's GPU memory needs CuPy (the gpu extra)") from exc
        self._runtime = cupy.cuda.runtime
        index = device.index if device.index is not None else torch.cuda.current_device()
        with cupy.cuda.Device(index):
            try:
                self._base = self._runtime.ipcOpenMemHandle(handle.handle)
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                raise IpcUnavailable(f"could not open the peer's CUDA IPC handle: {exc}") from exc
            memory = cupy.cuda.UnownedMemory(self._base + handle.offset_bytes, handle.num_bytes, self, index)
            flat = cupy.ndarray((handle.num_bytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
        self.device, self._index, self._cupy_device = device, index, cupy.cuda.Device
        self.tensor = torch.as_tensor(flat, device=device).view(dtype)

    def close(self) -> None:
        """Unmap, once every copy queued from it is done (from any thread: on this handle's device)."""
        if self._base is None:
            return
        torch.cuda.current_stream(self.device).synchronize()
        self.tensor = None
        with self._cupy_device(self._index):
            self._runtime.ipcCloseMemHandle(self._base)
        self._base = None
