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
