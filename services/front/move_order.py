"""Moves into an instance that is still moving requests out.

The policy counts a moving request on its target from the moment it decides the move, but the request's blocks
stay on its source until the move commits. So when one tick moves A -> B and B -> C (load balancing does; so does
MELL draining into an instance it also relieves), B may have no room yet for what comes from A: in
bench/mell_live.py at four times the load, moves out of the target held the blocks of 57 of lb's 97 refused
reservations before what follows, of 4 of 32 after. A tick starts the moves out of an instance first; a move into
one without room for it waits for the moves out of that instance that started before it (never for later ones:
two moves can never wait for each other), then reserves. Room is the front's own count: the instance's capacity
less the KV of the requests that really run there (a moving-out one until it commits) and of those moving in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Iterable, Sequence

from services.front.instances import Instance
from services.front.route import Route


def free_tokens(target: Instance, routes: Iterable[Route], tokens: Callable[[Route], int],
                excluding: Route | None = None) -> int:
    """KV tokens `target` has left: its capacity less `tokens(r)` for every request running there or moving
    there (`excluding` one: the move asking)."""
    used = sum(tokens(r) for r in routes if r is not excluding and (r.instance is target or r.destination is target))
    return target.capacity_tokens - used


def leaving_first(moves: Sequence[tuple[Hashable, Hashable]]) -> list[int]:
    """The order to start a tick's (source, destination) moves in: a move out of an instance before the moves into
    it, so that these wait for its room and not the other way round (a move waits only for older ones); moves
    that form a cycle (a swap) go in their given order. -> the indices of `moves`, each once."""
    waits_on = [sum(1 for j, (source, _) in enumerate(moves) if j != i and source == destination)
                for i, (_, destination) in enumerate(moves)]  # moves out of i's destination, still to start
    order, started = [], [False] * len(moves)
    while len(order) < len(moves):
        ready = [i for i in range(len(moves)) if not started[i] and waits_on[i] == 0]
        i = ready[0] if ready else started.index(False)  # a cycle: the first of it goes as given
        started[i] = True
        order.append(i)
        for k, (_, destination) in enumerate(moves):
            if not started[k] and k != i and destination == moves[i][0]:
                waits_on[k] -= 1
    return order


class Outgoing:
    """Moves in flight by the instance they leave, in the order they started: each a future done when it ends."""

    def __init__(self) -> None:
        self._leaving: dict[int, list[asyncio.Future]] = {}  # id(source instance) -> its moves' futures

    def from_(self, instance: Instance) -> list[asyncio.Future]:
        """The moves out of `instance` now (every one started before the caller asks)."""
        return list(self._leaving.get(id(instance), ()))

    def begin(self, source: Instance, move: asyncio.Future) -> None:
        self._leaving.setdefault(id(source), []).append(move)

    def end(self, source: Instance, move: asyncio.Future) -> None:
        moves = self._leaving.get(id(source), [])
        if move in moves:
            moves.remove(move)
        if not moves:
            self._leaving.pop(id(source), None)
