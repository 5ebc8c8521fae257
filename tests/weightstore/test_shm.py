"""Shared-memory segments: creation, read-only attachment, unlinking, stale cleanup."""

from __future__ import annotations

import os
import stat
import subprocess
import uuid

import pytest

from services.weightstore.shm import (
    SEGMENT_PREFIX,
    ShmSegment,
    cleanup_stale_segments,
    list_segments,
    owner_pid,
    segment_name,
)
from tests.conftest import wait_until

from . import no_leftover_segments  # noqa: F401  (session fixture)

pytestmark = pytest.mark.usefixtures("no_leftover_segments")


@pytest.fixture
def name():
    """A fresh segment name for this process; unlinked after the test whatever happened."""
    name = segment_name(os.getpid(), 10_000 + uuid.uuid4().int % 1_000_000)
    yield name
    if os.path.exists(f"/dev/shm/{name}"):
        os.unlink(f"/dev/shm/{name}")


@pytest.fixture
def prefix():
    """A prefix of its own, so cleanup tests never see other processes' segments."""
    prefix = f"reconfig-wstest-{uuid.uuid4().hex[:8]}-"
    yield prefix
    for leftover in list_segments(prefix):
        os.unlink(f"/dev/shm/{leftover}")


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_create_attach_readback(name):
    segment = ShmSegment.create(name, 4096)
    payload = bytes(range(256)) * 3
    segment.buffer[100 : 100 + len(payload)] = payload
    reader = ShmSegment.attach(name)
    assert reader.size == 4096
    assert bytes(reader.buffer[100 : 100 + len(payload)]) == payload
    assert reader.buffer.readonly
    with pytest.raises(TypeError):
        reader.buffer[0:1] = b"x"
    segment.buffer[0:4] = b"abcd"  # a shared mapping: the writer's later change is visible
    assert bytes(reader.buffer[0:4]) == b"abcd"
    reader.close()
    segment.close()
    segment.unlink()


def test_mode_is_owner_only_and_name_is_exclusive(name):
    previous_umask = os.umask(0)  # even with a permissive umask the segment stays 0600
    try:
        segment = ShmSegment.create(name, 64)
    finally:
        os.umask(previous_umask)
    assert stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode) == 0o600
    with pytest.raises(FileExistsError):
        ShmSegment.create(name, 64)
    segment.close()
    segment.unlink()


def test_copy_on_write_attachment_never_changes_the_segment(name):
    segment = ShmSegment.create(name, 128)
    segment.buffer[0:3] = b"abc"
    private = ShmSegment.attach(name, readonly=True, copy_on_write=True)
    private.buffer[0:3] = b"xyz"
    assert bytes(private.buffer[0:3]) == b"xyz"
    assert bytes(segment.buffer[0:3]) == b"abc"
    assert bytes(ShmSegment.attach(name).buffer[0:3]) == b"abc"
    private.close()
    segment.close()
    segment.unlink()


def test_unlink_is_idempotent_and_mappings_survive_it(name):
    segment = ShmSegment.create(name, 64)
    segment.buffer[0:2] = b"ok"
    reader = ShmSegment.attach(name)
    segment.unlink()
    segment.unlink()
    assert name not in list_segments()
    with pytest.raises(FileNotFoundError):
        ShmSegment.attach(name)
    assert bytes(reader.buffer[0:2]) == b"ok"  # unlinked, still mapped
    reader.close()
    segment.close()
    segment.close()  # idempotent too
    with pytest.raises(ValueError):
        segment.buffer


def test_close_keeps_mapping_while_a_view_is_alive(name):
    segment = ShmSegment.create(name, 64)
    segment.buffer[0:5] = b"hello"
    reader = ShmSegment.attach(name)
    view = reader.buffer[0:5]
    reader.close()  # must not unmap memory that `view` still points to
    assert reader.is_closed
    assert bytes(view) == b"hello"
    view.release()
    segment.close()
    segment.unlink()


def test_cleanup_removes_dead_owners_only(prefix):
    dead = segment_name(dead_pid(), 0, prefix)
    live = segment_name(os.getpid(), 0, prefix)
    foreign = f"{prefix}not-a-pid"
    for segment_name_ in (dead, live, foreign):
        segment = ShmSegment.create(segment_name_, 64)
        segment.close()
    assert cleanup_stale_segments(prefix) == [dead]
    assert list_segments(prefix) == sorted([live, foreign])
    assert cleanup_stale_segments(prefix) == []


def test_names_encode_the_owner():
    assert segment_name(1234, 5) == f"{SEGMENT_PREFIX}1234-5"
    assert owner_pid(segment_name(1234, 5)) == 1234
    assert owner_pid(f"{SEGMENT_PREFIX}x-1") is None
    assert owner_pid("other-1234-5") is None


@pytest.mark.parametrize("bad", ["", "a/b", "..", "../etc"])
def test_rejects_names_that_escape_dev_shm(bad):
    with pytest.raises(ValueError):
        ShmSegment.create(bad, 64)


def test_rejects_empty_segments(name):
    with pytest.raises(ValueError):
        ShmSegment.create(name, 0)


def test_a_zombie_owner_is_dead():
    """A worker killed with SIGKILL is a zombie until its parent reaps it: its segments are orphans already."""
    from services.weightstore.shm import is_process_alive

    child = os.fork()
    if child == 0:
        os._exit(0)
    try:
        def zombie() -> bool:  # exited, not reaped yet
            with open(f"/proc/{child}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "Z"

        wait_until(zombie, what="the child to exit")
        assert not is_process_alive(child)
    finally:
        os.waitpid(child, 0)
    assert is_process_alive(os.getpid())
