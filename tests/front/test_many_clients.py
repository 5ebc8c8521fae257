"""200 streaming clients through the front router while requests move between instances: none is lost, every
one ends with the tokens of an unmoved run."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.front.engine import MoveRefused
from services.router.contracts import GenerationRequest
from tests.front.conftest import open_front
from tests.front.test_live_moves import _reference

pytestmark = pytest.mark.asyncio

NUM_CLIENTS = 200
PROMPTS = [[(5 * k + 3 * i) % 89 + 2 for i in range(6 + 3 * k)] for k in range(8)]
MAX_TOKENS = 48
LONG_TOKENS = 192  # every tenth client: requests that live long enough for moves of two pre-copy rounds
MOVE_ROOM = 48     # the mover picks requests with at least this many tokens still to come (in the front's view)


async def test_200_streaming_clients_while_requests_move(instances):
    # Greedy: a shorter request's tokens are the first ones of a longer one's.
    reference = [await _reference(instances.engines[0], p, f"ref-{k}", LONG_TOKENS) for k, p in enumerate(PROMPTS)]
    rng = random.Random(3)
    async with open_front(instances, policy="mell") as front:
        done = asyncio.Event()

        async def client(i: int) -> list[int]:
            request = GenerationRequest(f"c{i}", tuple(PROMPTS[i % len(PROMPTS)]), _max_tokens(i))
            return [t for delta in [d async for d in front.generate(request)] for t in delta.token_ids]

        async def mover() -> None:
            """Moves running requests to another instance, one after the other, until the clients are done."""
            while not done.is_set():
                candidates = [rid for rid, route in front._routes.items()  # decoding, far from its end
                              if 0 < len(route.seq.output_token_ids) <= route.request.max_tokens - MOVE_ROOM
                              and not route.moving]
                if not candidates:
                    await asyncio.sleep(0.01)  # noqa: ASYNC110 (polls for work; the assertions do not depend on it)
                    continue
                request_id = rng.choice(candidates)
                route = front._routes.get(request_id)
                targets = [i for i in instances.instances if route is not None and i is not route.instance]
                try:
                    await front.move(request_id, rng.choice(targets))
                except (KeyError, MoveRefused, IndexError):
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
