"""The staging thread's duty cycle (services/worker/pacing.py): rest in proportion to the work, never for nothing."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.worker.pacing import Pacer


class FakeTime:
    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@given(duty=st.floats(0.05, 1.0), pieces=st.lists(st.floats(0.0, 2.0), max_size=20))
def test_work_stays_at_the_duty_of_the_wall_time(duty, pieces):
    fake = FakeTime()
    pacer = Pacer(duty, sleep=fake.sleep, clock=fake.clock)
    for seconds in pieces:
        with pacer.piece():
            fake.now += seconds
    worked = sum(pieces)
    assert pacer.worked_s == pytest.approx(worked)
    assert fake.now == pytest.approx(worked / duty)  # work + rest: the work is `duty` of it
    assert pacer.rested_s == pytest.approx(sum(fake.slept))
    if duty == 1.0 or worked == 0:
        assert not fake.slept


def test_a_failed_piece_still_rests_and_a_bad_duty_is_refused():
    fake = FakeTime()
    pacer = Pacer(0.25, sleep=fake.sleep, clock=fake.clock)
    with pytest.raises(RuntimeError), pacer.piece():
        fake.now += 1.0
        raise RuntimeError("the copy failed")
    assert fake.slept == [pytest.approx(3.0)]
    for bad in (0.0, -0.5, 1.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="duty"):
            Pacer(bad)


def test_staged_weights_are_packed_on_a_thread_that_has_ended(tmp_path, monkeypatch):
    """MKL computes a packed weight with part of the cores while the thread that packed it lives on: staging packs
    on a thread of its own that has ended when it returns (never on the long-lived stage thread)."""
    import threading

    import torch
    from safetensors.torch import load_file

    from services.model.layers import Linear, ShardLoader, SingleRankGroup
    from services.model.llama import ShardedCausalLM
    from services.model.spec import ModelSpec
    from services.topology import Topology, place
    from services.worker.staging import pack_on_own_thread
    from tests.conftest import make_checkpoint

    model_dir = make_checkpoint(tmp_path / "m", "llama")
    spec, tensors = ModelSpec.from_dir(model_dir), load_file(model_dir / "model.safetensors")
    model = ShardedCausalLM(spec, place(Topology(1, 1), spec.shape).workers[0],
                            ShardLoader(tensors.__getitem__, set(tensors), torch.float32, torch.device("cpu")),
                            SingleRankGroup())
    inputs = [torch.randn(3, linear.weight.shape[1]) for linear in model._linears()]
    before = [linear(x) for linear, x in zip(model._linears(), inputs)]
    packers: list[threading.Thread] = []
    pack = Linear.pack

    def recording_pack(linear: Linear) -> None:  # the real pack, and the thread it ran on
        packers.append(threading.current_thread())
        pack(linear)

    monkeypatch.setattr(Linear, "pack", recording_pack)
    pack_on_own_thread(model, Pacer())
    assert len(packers) == len(model._linears())
    (thread,) = set(packers)
    assert thread is not threading.current_thread() and not thread.is_alive()
    if torch.backends.mkl.is_available():
        assert all(linear.packed is not None for linear in model._linears())
    for linear, x, expected in zip(model._linears(), inputs, before):  # packed or not, the same layer
        torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-5)


def test_a_failure_while_packing_is_raised_on_the_callers_thread():
    from services.worker.staging import pack_on_own_thread

    class Broken:
        def pack_weights(self, piece) -> None:
            raise MemoryError("no room for the packed copy")

    with pytest.raises(MemoryError, match="no room"):
        pack_on_own_thread(Broken(), Pacer())
