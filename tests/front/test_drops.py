"""Why the front does not start a move its policy asked for (counted by reason: reconfig:front_migrations_dropped)."""

from __future__ import annotations

from services.front.engine import FrontSettings, not_started
from services.front.route import Route
from services.router.contracts import GenerationRequest
from services.router.sequence import Sequence


def _route(generated: int, moving: bool = False) -> Route:
    request = GenerationRequest("r", (5, 6, 7), 8)
    seq = Sequence.from_request(request)
    seq.output_token_ids = list(range(generated))
    return Route(request, wire=None, seq=seq, instance=None, moving=moving)


def test_a_move_starts_for_a_request_not_moving_with_a_target_and_a_free_slot():
    settings, target = FrontSettings(max_concurrent_moves=2), object()
    assert not_started(_route(1), target, settings, 1) == ""
    assert not_started(_route(0), target, settings, 1) == ""  # before its first token too
    assert not_started(_route(1), target, settings, 2) == "busy"
    assert not_started(_route(1, moving=True), target, settings, 0) == "moving"
    assert not_started(_route(1), None, settings, 0) == "no_room"
    assert not_started(_route(1), target, FrontSettings(migrate=False), 0) == "disabled"
