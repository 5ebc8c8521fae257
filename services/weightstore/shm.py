"""POSIX shared-memory segments as files under /dev/shm, without multiprocessing's resource tracker.

multiprocessing.shared_memory registers every segment it touches with a resource tracker that
unlinks it when the *attaching* process exits; a worker that maps the weights must never remove
them. Segments here are plain files in /dev/shm (what shm_open uses on Linux): the owning store
unlinks its own segments, and a restarted store removes those left by a predecessor that died.
"""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "reconfig-ws-"
# Owner-only: weights may be proprietary, and no other user should map or truncate them.
SEGMENT_MODE = 0o600


def segment_name(pid: int, index: int, prefix: str = SEGMENT_PREFIX) -> str:
    """Name of segment `index` owned by process `pid`."""
    return f"{prefix}{pid}-{index}"


def owner_pid(name: str, prefix: str = SEGMENT_PREFIX) -> int | None:
    """Pid encoded in a segment name, or None when the name does not follow the scheme."""
    match = re.fullmatch(re.escape(prefix) + r"(\d+)-(\d+)", name)
    return int(match.group(1)) if match else None


class ShmSegment:
    """One mapped shared-memory segment; `buffer` is a memoryview over its bytes."""

    __slots__ = ("name", "size", "is_readonly", "_mmap", "_buffer")

    def __init__(self, name: str, size: int, mapping: mmap.mmap, is_readonly: bool) -> None:
        self.name = name
        self.size = size
        self.is_readonly = is_readonly
        self._mmap: mmap.mmap | None = mapping
        self._buffer: memoryview | None = memoryview(mapping)

    @classmethod
    def create(cls, name: str, size: int) -> ShmSegment:
        """Create a new segment of `size` bytes (mode 0600); FileExistsError if the name is taken."""
        if size <= 0:
            raise ValueError(f"segment size must be positive, got {size}")
        path = _path(name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, SEGMENT_MODE)
        try:
            os.fchmod(fd, SEGMENT_MODE)  # the umask may have narrowed it; never widen beyond 0600
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)  # the mapping keeps the memory; the descriptor is no longer needed
        return cls(name, size, mapping, is_readonly=False)

    @classmethod
    def attach(cls, name: str, readonly: bool = True, copy_on_write: bool = False) -> ShmSegment:
        """Map an existing segment.

        readonly: the segment file is opened read-only, so this process can never change it.
        copy_on_write (with readonly): the mapping is private and writable; writes stay in this
        process's own pages, the shared bytes are untouched (lets torch build writable views).
        """
        if copy_on_write and not readonly:
            raise ValueError("copy_on_write applies to read-only attachments")
        fd = os.open(_path(name), os.O_RDONLY if readonly else os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise ValueError(f"segment {name} is empty")
            if copy_on_write:
                access = mmap.ACCESS_COPY
            else:
                access = mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE
            mapping = mmap.mmap(fd, size, access=access)
        finally:
            os.close(fd)
        return cls(name, size, mapping, is_readonly=readonly and not copy_on_write)

    @property
    def buffer(self) -> memoryview:
        """The mapped bytes; raises ValueError once closed."""
        if self._buffer is None:
            raise ValueError(f"segment {self.name} is closed")
        return self._buffer

    @property
    def is_closed(self) -> bool:
        """True once close() has run."""
        return self._buffer is None

    def close(self) -> None:
        """Unmap. If views of the buffer are still alive, the mapping lives until the last one dies."""
        if self._buffer is None:
            return
        self._buffer.release()
        self._buffer = None
        mapping, self._mmap = self._mmap, None
        try:
            mapping.close()
        except BufferError:
            pass  # exported views (e.g. torch tensors) hold the mapping; it unmaps when they go

    def unlink(self) -> None:
        """Remove the segment's name; idempotent. Existing mappings stay valid until unmapped."""
        unlink_segment(self.name)

    def __repr__(self) -> str:
        return f"ShmSegment(name={self.name!r}, size={self.size}, readonly={self.is_readonly})"


def unlink_segment(name: str) -> bool:
    """Remove segment `name`; returns False if it did not exist."""
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        return False
    return True


def list_segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Names of the existing segments that start with `prefix`, sorted."""
    try:
        return sorted(entry.name for entry in os.scandir(SHM_DIR) if entry.name.startswith(prefix))
    except FileNotFoundError:
        return []


def is_process_alive(pid: int) -> bool:
    """True if a process with this pid runs (possibly owned by another user). A zombie does not: a worker killed
    with SIGKILL stays one until its parent (the forkserver) reaps it, and its segments are already orphans."""
    if pid <= 0:  # kill(0 or negative) would signal process groups, not a process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (or it went away meanwhile): kill() said it exists


def cleanup_stale_segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Unlink segments whose owner pid is dead; return their names. Live owners' segments stay."""
    removed = []
    for name in list_segments(prefix):
        pid = owner_pid(name, prefix)
        if pid is None or is_process_alive(pid):
            continue
        try:
            if unlink_segment(name):
                removed.append(name)
        except PermissionError:
            log.warning("weightstore.stale_segment_not_removable", segment=name)
    if removed:
        log.info("weightstore.stale_segments_removed", segments=removed)
    return removed


def _path(name: str) -> str:
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"invalid segment name {name!r}")
    return str(SHM_DIR / name)
