"""The front router's scaling decision (services/front/autoscale.py), as a pure function: it never starts past
max_instances nor while a standby instance is left, never stops below min_instances, while requests wait, or an
instance whose processes are kept; it starts only after requests waited start_after_s, and stops the instance
idle longest once it was idle stop_after_s."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.front.autoscale import AutoscaleSettings, ScaleView, decide

NAMES = [f"i{n}" for n in range(6)]


@st.composite
def situations(draw):
    min_instances = draw(st.integers(1, 3))
    settings = AutoscaleSettings(max_instances=draw(st.integers(min_instances, 6)), min_instances=min_instances,
                                 start_after_s=draw(st.sampled_from([0.0, 2.0])),
                                 stop_after_s=draw(st.sampled_from([0.0, 1.0, 60.0])))
    num_instances = draw(st.integers(1, 6))
    now = 100.0
    standby = draw(st.lists(st.sampled_from(NAMES[:num_instances]), unique=True))
    view = ScaleView(now=now, num_instances=num_instances,
                     waiting_since=draw(st.one_of(st.none(), st.floats(0, now))),
                     standby_since={name: draw(st.floats(0, now)) for name in standby},
                     stoppable=frozenset(draw(st.lists(st.sampled_from(standby), unique=True)) if standby else []))
    return view, settings


@given(situations())
def test_the_decision_keeps_every_bound(situation):
    view, settings = situation
    decision = decide(view, settings)
    if decision is None:
        return
    action, name = decision
    if action == "start":
        assert view.num_instances < settings.max_instances and not view.standby_since
        assert view.waiting_since is not None and view.now - view.waiting_since >= settings.start_after_s
    else:
        assert action == "stop" and view.waiting_since is None and view.num_instances > settings.min_instances
        assert name in view.stoppable and view.now - view.standby_since[name] >= settings.stop_after_s
        assert view.standby_since[name] == min(view.standby_since[n] for n in view.stoppable)  # idle longest


def test_it_starts_when_requests_wait_and_stops_what_stays_idle():
    settings = AutoscaleSettings(max_instances=3, min_instances=1, start_after_s=2.0, stop_after_s=10.0)
    waiting = ScaleView(now=10.0, num_instances=1, waiting_since=9.0, standby_since={}, stoppable=frozenset())
    assert decide(waiting, settings) is None                                 # not waited long enough
    assert decide(ScaleView(11.0, 1, 9.0, {}, frozenset()), settings) == ("start", "")
    assert decide(ScaleView(11.0, 3, 9.0, {}, frozenset()), settings) is None   # at max_instances
    assert decide(ScaleView(11.0, 2, 9.0, {"i1": 0.0}, frozenset({"i1"})), settings) is None  # a standby left
    idle = ScaleView(30.0, 3, None, {"i1": 25.0, "i2": 12.0}, frozenset({"i1", "i2"}))
    assert decide(idle, settings) == ("stop", "i2")                          # idle 18 s; i1 only 5 s
    assert decide(ScaleView(30.0, 1, None, {"i0": 0.0}, frozenset({"i0"})), settings) is None  # min_instances
    assert decide(idle, AutoscaleSettings()) is None                         # off


def test_bad_settings_are_refused():
    for kwargs in ({"max_instances": -1}, {"min_instances": 0}, {"max_instances": 1, "min_instances": 2},
                   {"start_after_s": -1.0}, {"interval_s": 0.0}):
        with pytest.raises(ValueError):
            AutoscaleSettings(**kwargs)
