"""Policy instances ("slots", the placement policy's instance ids) bound to real instances: the one owner of that map.

The policy opens and releases instances as numbers; a slot is bound to an in-service instance no other slot holds
(a standby one) when the policy first uses it, and unbound once the policy released it and no request runs there.
"""

from __future__ import annotations

import structlog

from services.front.instances import Instance
from services.router.contracts import QueueFullError

log = structlog.get_logger(__name__)


class Slots:
    def __init__(self, instances: list[Instance]) -> None:
        self.instances = instances
        self._bound: dict[str, Instance] = {}  # slot -> the instance it is bound to

    def get(self, slot: str) -> Instance | None:
        return self._bound.get(slot)

    def bind(self, slot: str) -> Instance:
        """The slot's instance, binding it to a standby one first (QueueFullError: none is left)."""
        instance = self._bound.get(slot)
        if instance is None or not instance.in_service:
            free = self.standby()
            if not free:
                raise QueueFullError("every instance is in use, drained or down")
            instance = self._bound[slot] = free[0]
            log.info("front.instance_bound", slot=slot, instance=instance.name)
        return instance

    def bind_to(self, slot: str, instance: Instance) -> None:
        """Bind a slot the policy just opened for a request already on `instance` (an operator's move)."""
        self._bound.setdefault(slot, instance)

    def standby(self) -> list[Instance]:
        """Instances in service that no slot is bound to."""
        bound = {id(i) for i in self._bound.values()}
        return [i for i in self.instances if i.in_service and id(i) not in bound]

    def slot_of(self, instance: Instance) -> str | None:
        return next((slot for slot, bound in self._bound.items() if bound is instance), None)

    def hand_over(self, instance: Instance, target: Instance | None) -> None:
        """A drain: the instance's slots go to `target` (None: they are unbound)."""
        for slot in [s for s, bound in self._bound.items() if bound is instance]:
            if target is None:
                del self._bound[slot]
            else:
                self._bound[slot] = target

    def release_unused(self, live_slots, busy: set[int]) -> None:
        """Unbind the slots the policy released whose instance holds no request (`busy`: ids of those that do)."""
        for slot in [s for s, i in self._bound.items() if s not in live_slots and id(i) not in busy]:
            log.info("front.instance_released", slot=slot, instance=self._bound.pop(slot).name)
