"""The operator's instance operations on the front router: list, drain (and put back), add and remove instances.

`reconfigctl instances` reaches them through the Front service (services.front.server), and the autoscaler and the
launcher call them too. `InstanceAdmin` is a base class of services.front.engine.FrontEngine: the operations change
the engine's instances, slots and policy, and a drain moves the drained instance's requests live, through the
engine's own moves. What they use of the engine is declared on the class, so this module imports nothing of it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog

from services.front.instances import Instance, free_name
from services.front.route import Route
from services.front.slots import Slots
from services.placement import BasePolicy

if TYPE_CHECKING:
    from services.front.mover import MoveResult

log = structlog.get_logger(__name__)


class MoveRefused(RuntimeError):
    """An operator's drain cannot run (no standby instance to take the requests): FAILED_PRECONDITION."""


class InstanceAdmin:
    """Drain, add, remove and list the front's instances (a base class of FrontEngine, which holds the state)."""

    # The engine's state these operations read and change (FrontEngine sets every one).
    instances: list[Instance]
    slots: Slots
    policy: BasePolicy
    max_model_len: int
    _routes: dict[str, Route]
    _room: asyncio.Event
    _kv_unreachable: set[tuple[str, str]]

    if TYPE_CHECKING:  # the engine's methods they call
        def requests_on(self, instance: Instance) -> list[Route]: ...

        async def _move(self, route: Route, target: Instance, policy_source: str | None = None,
                        reprefill: bool = False) -> MoveResult: ...

    async def drain_instance(self, name: str, drain: bool = True) -> tuple[int, int, Instance]:
        """Take an instance out of service: its slot moves to a standby instance, and so do its running requests,
        live. (moved, failed, it); KeyError: no such instance; MoveRefused: no standby instance to take its
        place. drain=False puts it back in service."""
        instance = self.instance(name)
        if not drain:
            instance.is_drained = False
            self._room.set()  # requests waiting for room may fit there
            return 0, 0, instance
        routes = [r for r in self._routes.values() if r.instance is instance and not r.moving]
        target = None
        if routes:
            free = [i for i in self.slots.standby() if i is not instance]
            if not free:
                raise MoveRefused(f"no standby instance can take the requests of {name}: start more instances or "
                                  "wait until one is released")
            target = free[0]
        instance.is_drained = True
        self.slots.hand_over(instance, target)
        log.info("front.instance_drained", instance=name, requests=len(routes),
                 to=target.name if target is not None else None)
        for route in routes:
            route.moving = True
        results = await asyncio.gather(*(self._move(route, target) for route in routes))
        moved = sum(1 for r in results if r.moved)
        return moved, len(results) - moved, instance

    async def add_instance(self, address: str, name: str = "") -> Instance:
        """Serve another instance from now on (on standby until the policy needs one), named `name` (empty: the
        first free i<n>). ValueError: it cannot serve this front's requests (block size, KV, context), or the name
        is taken; grpc.aio.AioRpcError: it does not answer."""
        names = {i.name for i in self.instances}
        if name in names:
            raise ValueError(f"an instance is named {name!r} already")
        name = name or free_name(names)
        instance = Instance(name, address, self.instances[0].token, is_up=False,  # not up yet: fail fast
                            tls=self.instances[0].tls)
        try:
            stats = await instance.connect(timeout_s=10.0)
            instance.is_up = True
            block_size, capacity = self.instances[0].block_size, self.policy.config.capacity
            if instance.block_size != block_size:
                raise ValueError(f"{address} has KV blocks of {instance.block_size} tokens, this front {block_size}")
            if instance.capacity_tokens < capacity:
                raise ValueError(f"{address} holds {instance.capacity_tokens} KV tokens, the policy's instances "
                                 f"{capacity}")
            if stats.max_model_len < self.max_model_len:
                raise ValueError(f"{address} takes requests of {stats.max_model_len} tokens, this front "
                                 f"{self.max_model_len}")
        except BaseException:
            await instance.close()
            raise
        self.instances.append(instance)  # the slots see it as standby
        self.policy.set_max_instances(len(self.instances))
        self._room.set()  # requests waiting for room may fit there
        log.info("front.instance_added", instance=name, address=address, topology=instance.topology)
        return instance

    async def remove_instance(self, name: str) -> None:
        """Stop serving a drained instance that holds no request. KeyError: none of that name; MoveRefused: not
        drained, or requests run there."""
        instance = self.instance(name)
        if not instance.is_drained or self.requests_on(instance) or self.slots.slot_of(instance) is not None:
            raise MoveRefused(f"{name} must be drained and hold no request before it is removed "
                              "(reconfigctl instances drain)")
        self.instances.remove(instance)
        self._kv_unreachable = {pair for pair in self._kv_unreachable if name not in pair}
        self.policy.set_max_instances(len(self.instances))
        await instance.close()
        log.info("front.instance_removed", instance=name)

    def instance(self, name: str) -> Instance:
        """The instance of that name (KeyError: none)."""
        instance = next((i for i in self.instances if i.name == name), None)
        if instance is None:
            raise KeyError(name)
        return instance

    def instance_states(self) -> list[dict]:
        """Each instance as reconfigctl shows it."""
        states = []
        for instance in self.instances:
            routes = self.requests_on(instance)
            slot = self.slots.slot_of(instance) or ""
            state = ("down" if not instance.is_up else "drained" if instance.is_drained
                     else "in_use" if routes else "standby")
            states.append({"name": instance.name, "address": instance.address, "topology": instance.topology,
                           "state": state, "num_requests": len(routes),
                           "kv_tokens": sum(r.kv_tokens for r in routes),
                           "capacity_tokens": instance.capacity_tokens, "slot": slot})
        return states
