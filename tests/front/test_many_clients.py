"""200 streaming clients through the front router while requests move between instances: none is lost, every
one ends with the tokens of an unmoved run."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.front.instance_admin import MoveRefused
from services.front.route import Route
from services.router.contracts import GenerationRequest
from tests.conftest import until
from tests.front.conftest import open_front, reference_tokens

pytestmark = pytest.mark.asyncio

NUM_CLIENTS = 200
PROMPTS = [[(5 * k + 3 * i) % 89 + 2 for i in range(6 + 3 * k)] for k in range(8)]
MAX_TOKENS = 48
LONG_TOKENS = 192  # every tenth client: requests that live long enough for moves of two pre-copy rounds
MOVE_ROOM = 48     # the mover picks requests with at least this many tokens still to come (in the front's view)


async def test_200_streaming_clients_while_requests_move(instances):
    # Greedy: a shorter request's tokens are the first ones of a longer one's.
    reference = [await reference_tokens(instances.engines[0], p, f"ref-{k}", LONG_TOKENS)
                 for k, p in enumerate(PROMPTS)]
    rng = random.Random(3)
    async with open_front(instances, policy="mell") as front:
        done = asyncio.Event()

        async def client(i: int) -> list[int]:
            request = GenerationRequest(f"c{i}", tuple(PROMPTS[i % len(PROMPTS)]), _max_tokens(i))
            return [t for delta in [d async for d in front.generate(request)] for t in delta.token_ids]

        def candidates() -> list[Route]:
            """The requests decoding far from their end, not moving already."""
            return [route for instance in front.instances for route in front.requests_on(instance)
                    if 0 < len(route.seq.output_token_ids) <= route.request.max_tokens - MOVE_ROOM
                    and not route.moving]

        async def mover() -> None:
            """Moves running requests to another instance, one after the other, until the clients are done."""
            while True:
                # Stretches with no candidate are long: once the long clients are done, none is far from its end.
                found = await until(lambda: done.is_set() or candidates(), timeout_s=600,
                                    what="a request to move, or the clients' end")
                if found is True:  # the clients are done
                    return
                route = rng.choice(found)
                target = rng.choice([i for i in instances.instances if i is not route.instance])
                try:
                    await front.move(route.request.request_id, target)
                except (KeyError, MoveRefused):
                    continue  # it finished or started moving meanwhile

        moving = asyncio.create_task(mover())
        outputs = await asyncio.gather(*(client(i) for i in range(NUM_CLIENTS)))
        done.set()
        await moving
        # The policy's own moves (MELL: overflow, consolidation) and the mover's, all while the clients ran.
        assert front.totals.moves["moved"] >= 5, front.totals.moves
    for i, tokens in enumerate(outputs):
        assert tokens == reference[i % len(PROMPTS)][:_max_tokens(i)], f"client {i}"
    for engine in instances.engines:
        assert engine.scheduler.block_manager.num_used == 0 and not engine.scheduler.moves.parked


def _max_tokens(client: int) -> int:
    return LONG_TOKENS if client % 10 == 0 else MAX_TOKENS
