"""A move into an instance that is still moving a request out waits for that move to commit when the instance has
no room for it before (services/front/move_order.py): the chain X: s -> t, Y: u -> s, started together, both move."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio
from hypothesis import given
from hypothesis import strategies as st

from services.front.move_order import Outgoing, leaving_first
from tests.conftest import until
from tests.front.conftest import greedy_request, open_front, open_instances, reference_tokens, start_clusters


KV_TOKENS = 256  # per tp1pp1 instance: 3 layers x 2 KV heads x 16 x fp32 x K,V = 768 B per token
X_PROMPT = [(5 * i) % 200 + 3 for i in range(140)]
Y_PROMPT = [(11 * i) % 200 + 3 for i in range(130)]  # with X's: more than one instance holds
MAX_TOKENS = 100  # each alone still fits an instance at its end


@pytest.fixture(scope="module")
def tight_clusters(front_checkpoint):
    with start_clusters(front_checkpoint, kv_cache_bytes=KV_TOKENS * 768) as clusters:
        yield clusters


@pytest_asyncio.fixture
async def tight(tight_clusters):
    async with open_instances(tight_clusters) as opened:
        yield opened


async def test_a_move_into_an_instance_still_moving_out_waits_for_its_room(tight):
    reference = [await reference_tokens(tight.engines[0], p, f"ref-{i}", MAX_TOKENS)
                 for i, p in enumerate((X_PROMPT, Y_PROMPT))]
    async with open_front(tight, migrate=False) as front:
        outputs = {"x": [], "y": []}

        async def stream(request_id: str, prompt: list[int]) -> None:
            async for delta in front.generate(greedy_request(request_id, prompt, MAX_TOKENS)):
                outputs[request_id].extend(delta.token_ids)

        tasks = [asyncio.ensure_future(stream("x", X_PROMPT)), asyncio.ensure_future(stream("y", Y_PROMPT))]
        await until(lambda: min(len(o) for o in outputs.values()) >= 2, what="both requests decoding")
        where = {r.request.request_id: i for i in front.instances for r in front.requests_on(i)}
        s, u = where["x"], where["y"]
        assert s is not u  # they do not fit one instance together
        t = next(i for i in tight.instances if i is not s and i is not u)
        prefills = [e.num_full_prefills for e in tight.engines]
        # X leaves s for t while Y comes to s from u: s has room for Y only once X's move commits
        moved_x, moved_y = await asyncio.gather(front.move("x", t), front.move("y", s))
        assert front.totals.waited_for_room == 1
        await asyncio.gather(*tasks)
    assert moved_x.moved and moved_y.moved, (moved_x.error, moved_y.error)
    assert not moved_x.reprefilled and not moved_y.reprefilled
    assert [outputs["x"], outputs["y"]] == reference
    assert [e.num_full_prefills for e in tight.engines] == prefills  # both adopted with their KV
    for engine in tight.engines:
        assert engine.scheduler.block_manager.num_used == 0 and not engine.scheduler.moves.parked


async def test_outgoing_lists_the_moves_out_of_an_instance_until_they_end():
    outgoing, a, b = Outgoing(), object(), object()
    loop = asyncio.get_running_loop()
    first, second = loop.create_future(), loop.create_future()
    outgoing.begin(a, first)
    seen = outgoing.from_(a)  # what a move into `a` starting now waits for: the moves that began before it
    outgoing.begin(a, second)
    assert seen == [first] and outgoing.from_(a) == [first, second] and outgoing.from_(b) == []
    outgoing.end(a, first)
    outgoing.end(a, second)
    assert outgoing.from_(a) == []


_moves = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)).filter(lambda m: m[0] != m[1]), max_size=10)


@given(_moves)
def test_leaving_first_starts_each_move_once(moves):
    assert sorted(leaving_first(moves)) == list(range(len(moves)))


@given(_moves.map(lambda moves: [(min(m), max(m)) for m in moves]))  # instances ordered: no cycle of moves
def test_without_a_cycle_a_move_out_of_an_instance_starts_before_the_moves_into_it(moves):
    position = {i: p for p, i in enumerate(leaving_first(moves))}
    for j, (source, _) in enumerate(moves):
        for i, (_, destination) in enumerate(moves):
            if source == destination:
                assert position[j] < position[i], (moves, j, i)


def test_a_chain_starts_from_its_end_and_a_swap_as_given():
    assert leaving_first([("a", "b"), ("b", "c"), ("c", "d")]) == [2, 1, 0]
    assert leaving_first([("a", "b"), ("b", "a")]) == [0, 1]
