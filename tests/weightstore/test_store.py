"""WeightStore loading, the manifest, and mapping tensors back through MappedCheckpoint."""

from __future__ import annotations

import json
import os
import threading
import zlib

import pytest
import torch

from services.weightstore.client import MappedCheckpoint
from services.weightstore.manifest import ALIGNMENT, Manifest
from services.weightstore.shm import ShmSegment
from services.weightstore.store import CheckpointError, LoadCancelled, WeightStore

from . import make_checkpoint, no_leftover_segments, raw_bytes, segments_of  # noqa: F401

pytestmark = pytest.mark.usefixtures("no_leftover_segments")


@pytest.fixture
def checkpoint(tmp_path):
    """A two-file checkpoint directory and its tensors."""
    return tmp_path, make_checkpoint(tmp_path)


@pytest.fixture
def store(checkpoint):
    with WeightStore.load(checkpoint[0]) as store:
        yield store


def test_every_tensor_maps_back_bit_for_bit(checkpoint, store):
    _, originals = checkpoint
    assert set(store.manifest.tensors) == set(originals)
    with MappedCheckpoint(store.manifest) as mapped:
        for name, original in originals.items():
            tensor = mapped.tensor(name)
            assert tensor.dtype == original.dtype, name
            assert tensor.shape == original.shape, name
            assert raw_bytes(tensor) == raw_bytes(original), name
            assert mapped.verify(name), name


def test_manifest_keeps_raw_dtypes_checksums_and_aligned_offsets(checkpoint, store):
    model_dir, originals = checkpoint
    manifest = store.manifest
    dtypes = {name: entry.dtype for name, entry in manifest.tensors.items()}
    assert dtypes["model.embed_tokens.weight"] == "F32"
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "BF16"
    assert dtypes["lm_head.weight"] == "F16"
    assert dtypes["mask"] == "BOOL"
    assert len(manifest.segments) == 2  # one per safetensors file
    sizes = {segment.name: segment.size for segment in manifest.segments}
    for name, entry in manifest.tensors.items():
        assert entry.offset % ALIGNMENT == 0, name
        assert entry.offset + entry.nbytes <= sizes[entry.segment], name
        assert entry.crc32 == zlib.crc32(raw_bytes(originals[name])), name
    assert manifest.total_bytes == sum(len(raw_bytes(tensor)) for tensor in originals.values())
    assert json.loads(manifest.config_json)["model_type"] == "llama"
    assert manifest.model_dir == str(model_dir.resolve())
    assert Manifest.from_pb(manifest.to_pb()) == manifest


def test_verify_detects_corruption(store):
    name = "model.embed_tokens.weight"
    entry = store.manifest.tensors[name]
    writer = ShmSegment.attach(entry.segment, readonly=False)
    writer.buffer[entry.offset] ^= 0xFF
    with MappedCheckpoint(store.manifest) as mapped:
        assert not mapped.verify(name)
        assert mapped.verify("model.norm.weight")
    writer.close()


def test_writes_to_a_view_stay_private(checkpoint, store):
    _, originals = checkpoint
    name = "model.layers.0.mlp.gate_proj.weight"
    with MappedCheckpoint(store.manifest) as first, MappedCheckpoint(store.manifest) as second:
        view = first.tensor(name)
        view.add_(1.0)  # a worker mutating its view must not corrupt the shared weights
        assert torch.equal(second.tensor(name), originals[name])
        assert second.verify(name)


def test_views_outlive_close_of_reader_and_store(checkpoint, tmp_path):
    _, originals = checkpoint
    store = WeightStore.load(tmp_path)
    mapped = MappedCheckpoint(store.manifest)
    view = mapped.tensor("lm_head.weight")
    mapped.close()
    store.close()
    assert torch.equal(view, originals["lm_head.weight"])  # still backed by the (unlinked) segment


def test_close_unlinks_every_segment(checkpoint):
    store = WeightStore.load(checkpoint[0])
    names = [segment.name for segment in store.manifest.segments]
    assert set(names) <= set(segments_of(os.getpid()))
    assert all(name.startswith(f"reconfig-ws-{os.getpid()}-") for name in names)
    store.close()
    store.close()
    assert segments_of(os.getpid()) == []
    assert store.is_closed


def test_two_stores_in_one_process_use_distinct_segments(checkpoint):
    with WeightStore.load(checkpoint[0]) as first, WeightStore.load(checkpoint[0]) as second:
        assert {s.name for s in first.manifest.segments}.isdisjoint(s.name for s in second.manifest.segments)


def test_pickle_only_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match="safetensors") as error:
        WeightStore.load(tmp_path)
    assert "pickle" in str(error.value)
    assert segments_of(os.getpid()) == []


def test_missing_config_is_a_clear_error(tmp_path):
    make_checkpoint(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json not found"):
        WeightStore.load(tmp_path)


def test_directory_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        WeightStore.load(tmp_path)


def test_index_selects_the_files(tmp_path):
    originals = make_checkpoint(tmp_path, with_index=True)
    stray = {"duplicate.embed": torch.ones(4)}
    from safetensors.torch import save_file

    save_file(stray, str(tmp_path / "consolidated.safetensors"))  # not in the index: ignored
    with WeightStore.load(tmp_path) as store:
        assert set(store.manifest.tensors) == set(originals)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing files"):
        WeightStore.load(tmp_path)


def test_corrupt_second_file_leaves_no_segments(tmp_path):
    make_checkpoint(tmp_path)
    path = tmp_path / "model-00002-of-00002.safetensors"
    path.write_bytes(path.read_bytes()[:-10])  # truncated: the last tensor's bytes are cut
    with pytest.raises(CheckpointError, match="model-00002"):
        WeightStore.load(tmp_path)
    assert segments_of(os.getpid()) == []


def test_duplicate_tensor_across_files_is_an_error(tmp_path):
    make_checkpoint(tmp_path)
    from safetensors.torch import save_file

    save_file({"lm_head.weight": torch.zeros(2)}, str(tmp_path / "zz-extra.safetensors"))
    with pytest.raises(CheckpointError, match="in more than one file"):
        WeightStore.load(tmp_path)
    assert segments_of(os.getpid()) == []


def test_cancelled_load_leaves_no_segments(checkpoint):
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(LoadCancelled):
        WeightStore.load(checkpoint[0], cancel=cancel)
    assert segments_of(os.getpid()) == []


class StopAfter(threading.Event):
    """A cancel event that reports set from its n-th check on: stops a load part-way."""

    def __init__(self, num_checks: int) -> None:
        super().__init__()
        self.num_checks_left = num_checks

    def is_set(self) -> bool:
        self.num_checks_left -= 1
        return self.num_checks_left < 0


@pytest.mark.parametrize("num_checks", [1, 4, 7])
def test_load_stopped_part_way_unlinks_finished_and_partial_segments(checkpoint, num_checks):
    with pytest.raises(LoadCancelled):
        WeightStore.load(checkpoint[0], cancel=StopAfter(num_checks))
    assert segments_of(os.getpid()) == []


def test_manifest_rejects_entries_outside_their_segment(store):
    message = store.manifest.to_pb()
    message.tensors[0].offset = message.segments[0].size  # would read past the mapping
    with pytest.raises(ValueError, match="exceed"):
        Manifest.from_pb(message)
