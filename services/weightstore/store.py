"""WeightStore: a Hugging Face safetensors checkpoint copied once into POSIX shared memory."""

from __future__ import annotations

import atexit
import itertools
import json
import math
import os
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import structlog

from services.weightstore.manifest import ALIGNMENT, DTYPE_NUM_BYTES, Manifest, SegmentInfo, TensorEntry, align_up
from services.weightstore.shm import ShmSegment, segment_name, unlink_segment

log = structlog.get_logger(__name__)

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit
MAX_LOAD_THREADS = 8  # files copied at once; beyond this, memory bandwidth is the limit
_CHUNK_BYTES = 4 << 20  # read then checksum in cache-sized chunks: one pass over memory, not two

# Segment indices are unique per process, so several stores in one process never collide.
_segment_indices = itertools.count()


class CheckpointError(Exception):
    """The directory is not a loadable checkpoint (missing config, pickle only, corrupt file...)."""


class LoadCancelled(Exception):
    """Loading stopped because the cancel event was set; nothing was left in shared memory."""


@dataclass(frozen=True, slots=True)
class _HeaderTensor:
    """One tensor as a safetensors header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset of the data in the file
    nbytes: int


class WeightStore:
    """Owns the shared-memory segments holding one checkpoint, and its manifest."""

    def __init__(self, manifest: Manifest) -> None:
        self._manifest = manifest
        self._is_closed = False
        atexit.register(self.close)  # normal exit and unhandled exceptions; signals: see server

    @classmethod
    def load(cls, model_dir: Path, cancel: threading.Event | None = None) -> WeightStore:
        """Copy every tensor of `model_dir` into new segments (one per safetensors file, in parallel)."""
        model_dir = Path(model_dir).resolve()
        config_json = _read_config(model_dir)
        files, indexed_names = _safetensors_files(model_dir)
        headers_by_file = {path: _read_header(path) for path in files}
        _check_names(headers_by_file, indexed_names)  # before any byte is copied
        filled = _fill_segments(headers_by_file, cancel)
        tensors = {entry.name: entry for _, entries in filled for entry in entries}
        manifest = Manifest(
            model_dir=str(model_dir),
            config_json=config_json,
            tensors=tensors,
            segments=tuple(segment for segment, _ in filled),
            total_bytes=sum(entry.nbytes for entry in tensors.values()),
        )
        return cls(manifest)

    @property
    def manifest(self) -> Manifest:
        """Where every tensor lives."""
        return self._manifest

    @property
    def is_closed(self) -> bool:
        """True once the segments are unlinked."""
        return self._is_closed

    def close(self) -> None:
        """Unlink every segment; idempotent. Readers that still map them keep valid mappings."""
        if self._is_closed:
            return
        self._is_closed = True
        for segment in self._manifest.segments:
            unlink_segment(segment.name)
        atexit.unregister(self.close)

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _read_config(model_dir: Path) -> str:
    if not model_dir.is_dir():
        raise CheckpointError(f"checkpoint directory {model_dir} does not exist or is not a directory")
    config_path = model_dir / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{CONFIG_FILE} not found in {model_dir}: a Hugging Face checkpoint needs one")
    config_json = config_path.read_text(encoding="utf-8")
    try:
        if not isinstance(json.loads(config_json), dict):
            raise CheckpointError(f"{config_path} is not a JSON object")
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{config_path} is not valid JSON: {error}") from None
    return config_json


def _safetensors_files(model_dir: Path) -> tuple[list[Path], set[str] | None]:
    """The files to load (those the index names if there is one, else every *.safetensors), index names."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index_path} has no valid weight_map: {error}") from None
        # An index excludes stray files (e.g. Mistral's consolidated.safetensors) that duplicate weights.
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise CheckpointError(f"{index_path.name} names missing files: {missing}")
        return files, set(weight_map)
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files, None
    pickles = sorted({path.name for pattern in PICKLE_PATTERNS for path in model_dir.glob(pattern)})
    if pickles:
        raise CheckpointError(
            f"{model_dir} holds only pickle checkpoints ({', '.join(pickles)}): pickle checkpoints are "
            "refused for safety (loading one can run arbitrary code). Convert them to safetensors, e.g. "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir, safe_serialization=True), "
            "in an environment you trust."
        )
    raise CheckpointError(f"no *.safetensors files in {model_dir}")


def _read_header(path: Path) -> list[_HeaderTensor]:
    """Parse and validate a safetensors header; tensors sorted by their place in the file."""
    file_size = path.stat().st_size
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) != 8:
            raise CheckpointError(f"{path.name}: truncated safetensors file")
        header_size = int.from_bytes(prefix, "little")
        if header_size > MAX_HEADER_BYTES or 8 + header_size > file_size:
            raise CheckpointError(f"{path.name}: invalid safetensors header size {header_size}")
        try:
            header = json.loads(file.read(header_size))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{path.name}: safetensors header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: safetensors header is not a JSON object")
    data_start = 8 + header_size
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path.name}: malformed header entry for {name!r}") from None
        if not all(isinstance(value, int) and value >= 0 for value in (*shape, begin, end)):
            raise CheckpointError(f"{path.name}: tensor {name!r} has an invalid shape or offsets")
        if dtype not in DTYPE_NUM_BYTES:
            raise CheckpointError(f"{path.name}: tensor {name!r} has unsupported dtype {dtype!r}")
        nbytes = math.prod(shape) * DTYPE_NUM_BYTES[dtype]
        if end - begin != nbytes or begin < 0 or data_start + end > file_size:
            raise CheckpointError(f"{path.name}: tensor {name!r} offsets [{begin}, {end}) do not fit its shape/file")
        tensors.append(_HeaderTensor(name, dtype, shape, data_start + begin, nbytes))
    tensors.sort(key=lambda tensor: tensor.begin)
    return tensors


def _check_names(headers_by_file: dict[Path, list[_HeaderTensor]], indexed_names: set[str] | None) -> None:
    seen: dict[str, str] = {}
    for path, headers in headers_by_file.items():
        for tensor in headers:
            if tensor.name in seen:
                raise CheckpointError(f"tensor {tensor.name!r} is in more than one file: {seen[tensor.name]}, {path.name}")
            seen[tensor.name] = path.name
    missing = sorted(indexed_names - seen.keys()) if indexed_names is not None else []
    if missing:
        raise CheckpointError(f"{INDEX_FILE} lists tensors absent from the files: {missing[:5]}")


def _fill_segments(
    headers_by_file: dict[Path, list[_HeaderTensor]], cancel: threading.Event | None
) -> list[tuple[SegmentInfo, list[TensorEntry]]]:
    """Fill one segment per file, files in parallel (reads and crc32 release the GIL); file order kept.

    On any failure every segment is unlinked and the first real error (not a cancellation) raised.
    """
    failed = threading.Event()  # one file's error stops the others early

    def should_stop() -> bool:
        return failed.is_set() or (cancel is not None and cancel.is_set())

    pid = os.getpid()
    names = [segment_name(pid, next(_segment_indices)) for _ in headers_by_file]  # in file order
    num_threads = max(1, min(len(names), os.cpu_count() or 1, MAX_LOAD_THREADS))
    with ThreadPoolExecutor(num_threads, thread_name_prefix="weightstore-load") as pool:
        futures = [
            pool.submit(_fill_segment, name, path, headers, should_stop)
            for name, (path, headers) in zip(names, headers_by_file.items())
        ]
        for future in futures:
            future.add_done_callback(lambda done: failed.set() if done.exception() else None)
    errors = [future.exception() for future in futures if future.exception() is not None]
    if errors:
        for future in futures:
            if future.exception() is None:
                unlink_segment(future.result()[0].name)
        raise next((error for error in errors if not isinstance(error, LoadCancelled)), errors[0])
    return [future.result() for future in futures]


def _fill_segment(
    name: str, path: Path, headers: list[_HeaderTensor], should_stop: Callable[[], bool]
) -> tuple[SegmentInfo, list[TensorEntry]]:
    """Create segment `name` for one file's tensors, copy and checksum them."""
    size = max(ALIGNMENT, sum(align_up(tensor.nbytes) for tensor in headers))
    segment = _create_segment(name, size)
    entries = []
    try:
        offset = 0
        with open(path, "rb", buffering=0) as file:
            for tensor in headers:
                if should_stop():
                    raise LoadCancelled(f"loading {path.parent} stopped")
                with segment.buffer[offset : offset + tensor.nbytes] as target:
                    crc32 = _copy_with_crc32(file, tensor.begin, target, path)
                entries.append(TensorEntry(
                    name=tensor.name, dtype=tensor.dtype, shape=tensor.shape, segment=segment.name,
                    offset=offset, nbytes=tensor.nbytes, crc32=crc32,
                ))
                offset += align_up(tensor.nbytes)
    except BaseException:
        segment.close()
        segment.unlink()
        raise
    segment.close()  # the store only needs the name; the bytes stay in shared memory
    return SegmentInfo(name=segment.name, size=segment.size), entries


def _create_segment(name: str, size: int) -> ShmSegment:
    try:
        return ShmSegment.create(name, size)
    except FileExistsError:
        # This process never issued this index, so the segment belongs to a dead earlier process
        # that had the same pid (a restarted container); stale-segment cleanup cannot see it as dead.
        log.warning("weightstore.stale_segment_replaced", segment=name)
        unlink_segment(name)
        return ShmSegment.create(name, size)


def _copy_with_crc32(file, position: int, target: memoryview, path: Path) -> int:
    """Read file bytes at `position` into `target`; returns their crc32, computed while still in cache."""
    file.seek(position)
    crc32 = 0
    done = 0
    while done < len(target):
        with target[done : done + _CHUNK_BYTES] as chunk:
            count = file.readinto(chunk)
            if not count:
                raise CheckpointError(f"{path.name}: file ended inside tensor data")
            crc32 = zlib.crc32(chunk[:count], crc32)
        done += count
    return crc32
