"""EPLB's trigger and commit, on the router: it counts the steps and owns the step stream, so it can make every
worker install a new expert map at the same step.

A rebalance: PrepareExpertMap on every active worker (each stage agrees on its load and stages the new map and the
moved experts' weights while serving goes on), then the next step carries the epoch and every worker installs the
map before running it. A worker that fails to prepare aborts the rebalance everywhere: the old map stays on all.
The policy itself is pure (services/topology/eplb.py) and runs on the workers, on numbers they agreed on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np
import structlog

from services.rpc.errors import describe_error
from services.rpc.reconfig.v1 import router_pb2, worker_pb2, worker_pb2_grpc
from services.rpc.tls import aio_channel
from services.topology.eplb import layer_balancedness, logical_loads, physical_loads, rank_loads

log = structlog.get_logger(__name__)


class ExpertBalanceError(RuntimeError):
    """A rebalance that cannot start (FAILED_PRECONDITION): not an EP layout, or one is running."""


class ExpertBalanceAborted(RuntimeError):
    """A rebalance a worker failed (ABORTED): every worker keeps the old map."""


@dataclass(frozen=True, slots=True)
class EplbSettings:
    """--eplb and its knobs (the vLLM chapter's defaults)."""

    enabled: bool = False
    step_interval: int = 3000      # steps between automatic rebalances
    timeout_s: float = 120.0       # prepare + commit
    check_interval_s: float = 0.5  # how often the automatic trigger looks at the step count

    def __post_init__(self) -> None:
        if self.step_interval < 1:
            raise ValueError(f"eplb step_interval must be >= 1, got {self.step_interval}")
        if not self.timeout_s > 0:
            raise ValueError(f"eplb timeout_s must be > 0, got {self.timeout_s}")


def layer_balance(replies: Sequence[worker_pb2.ExpertLoad]) -> tuple[list[router_pb2.LayerBalance], float]:
    """Per sparse layer: the map, the load per physical slot summed over the EP ranks that hold the layer, the
    load per rank and its balancedness; and the overall balancedness (eplb.layer_balancedness)."""
    by_layer: dict[int, tuple[list[int], list[int], int]] = {}
    for reply in replies:
        for layer in reply.layers:
            phy2log, load, ep = by_layer.setdefault(layer.layer, (list(layer.phy2log), [0] * len(layer.load),
                                                                  reply.ep_size))
            for slot, count in enumerate(layer.load):
                load[slot] += count
    if not by_layer:
        return [], 1.0
    ordered = sorted(by_layer.items())
    ep = ordered[0][1][2]
    per_layer, overall = layer_balancedness(np.array([load for _, (_, load, _) in ordered]), ep)
    layers = [router_pb2.LayerBalance(layer=layer, phy2log=phy2log, load=load,
                                      rank_load=[int(x) for x in rank_loads(load, ep)], balancedness=value)
              for (layer, (phy2log, load, _)), value in zip(ordered, per_layer)]
    return layers, overall


class ExpertBalancer:
    """The router's EPLB: status, rebalance on demand, and every step_interval steps with --eplb."""

    def __init__(self, engine, settings: EplbSettings | None = None) -> None:
        self.engine = engine
        self.settings = settings or EplbSettings()
        self.epoch = 0
        self.num_rebalances = 0
        self.last_balancedness = 1.0
        self._running = False
        self._last_step = 0
        self._task: asyncio.Task | None = None

    # ---- the workers ---------------------------------------------------------------------------------------
    def _active(self) -> list[tuple[str, worker_pb2.WorkerInfo]]:
        driver = self.engine.driver
        return [(a, i) for a, i in zip(driver.addresses, driver.infos) if i.num_kv_blocks > 0]

    @property
    def is_expert_parallel(self) -> bool:
        return any(i.ep_size > 1 for _, i in self._active())

    async def _call_all(self, method: str, request) -> list:
        """One unary RPC on every active worker at once; the replies in worker order (exceptions in place)."""
        metadata = self.engine.driver.metadata

        async def call(address: str):
            async with aio_channel(address, self.engine.driver.tls, carries_token=bool(metadata)) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                return await getattr(stub, method)(request, metadata=metadata, timeout=self.settings.timeout_s)

        return await asyncio.gather(*(call(a) for a, _ in self._active()), return_exceptions=True)

    # ---- status ----------------------------------------------------------------------------------------------
    async def status(self) -> router_pb2.ExpertStatusResponse:
        response = router_pb2.ExpertStatusResponse(eplb_enabled=self.settings.enabled, epoch=self.epoch,
                                                   step_interval=self.settings.step_interval,
                                                   num_rebalances=self.num_rebalances)
        if not self.is_expert_parallel:
            return response
        replies = await self._call_all("GetExpertLoad", worker_pb2.GetExpertLoadRequest())
        failed = [r for r in replies if isinstance(r, BaseException)]
        if failed:
            raise ExpertBalanceAborted(f"a worker did not report its expert load: {_describe(failed[0])}")
        layers, overall = layer_balance(replies)
        response.expert_parallel = True
        response.ep_size = max(r.ep_size for r in replies)
        response.num_physical_experts = len(layers[0].phy2log) if layers else 0
        response.layers.extend(layers)
        response.balancedness = overall
        response.window_steps = min(r.num_steps for r in replies)
        self.last_balancedness = response.balancedness
        return response

    # ---- rebalance -------------------------------------------------------------------------------------------
    async def rebalance(self) -> router_pb2.RebalanceExpertsResponse:
        """Stage a new map on every worker (serving goes on), then commit it with the next step."""
        if not self.is_expert_parallel:
            raise ExpertBalanceError("EPLB needs an expert-parallel layout (epXppY) of a MoE model")
        if self._running:
            raise ExpertBalanceError("a rebalance is already running")
        self._running = True
        try:
            return await self._rebalance()
        finally:
            self._running = False
            self._last_step = self.engine.num_steps

    async def _rebalance(self) -> router_pb2.RebalanceExpertsResponse:
        epoch = self.epoch + 1
        started = time.perf_counter()
        old = await self.status()  # the live maps and the window's load on them (balancedness before)
        replies = await self._call_all("PrepareExpertMap", worker_pb2.PrepareExpertMapRequest(epoch=epoch))
        failed = [r for r in replies if isinstance(r, BaseException)]
        if failed:
            await self._call_all("AbortExpertMap", worker_pb2.AbortExpertMapRequest(epoch=epoch))
            if all(isinstance(r, grpc.aio.AioRpcError) and r.code() is grpc.StatusCode.FAILED_PRECONDITION
                   for r in failed):
                raise ExpertBalanceError(_describe(failed[0]))
            raise ExpertBalanceAborted(f"rebalance {epoch} aborted, the old expert map stays: "
                                       f"{_describe(failed[0])}")
        prepared = time.perf_counter()
        new_maps = {layer.layer: list(layer.phy2log) for reply in replies for layer in reply.layers}
        # Predicted: the window's logical load spread evenly over each expert's copies in the new map.
        # (every logical expert holds a slot, so the map's distinct ids are all of them)
        spread = [physical_loads(logical_loads(layer.load, layer.phy2log, len(set(layer.phy2log))),
                                 new_maps[layer.layer]) for layer in old.layers]
        after = layer_balancedness(np.array(spread), old.ep_size)[1] if spread else 1.0
        try:
            await asyncio.wait_for(self.engine.commit_expert_map(epoch), self.settings.timeout_s)
        except BaseException as exc:  # a failed step, a freeze, a timeout, or the caller went away
            # Shielded: a cancelled caller must not leave a staged map behind on the workers.
            await asyncio.shield(self._call_all("AbortExpertMap", worker_pb2.AbortExpertMapRequest(epoch=epoch)))
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise ExpertBalanceAborted(f"rebalance {epoch}: the commit step failed: {_describe(exc)}") from exc
        self.epoch = epoch
        self.num_rebalances += 1
        self.last_balancedness = after  # predicted; the next status() measures it
        response = router_pb2.RebalanceExpertsResponse(
            epoch=epoch, balancedness_before=old.balancedness, balancedness_after=after,
            bytes_moved=sum(r.bytes_received for r in replies), slots_changed=sum(r.slots_changed for r in replies),
            prepare_seconds=prepared - started, commit_seconds=time.perf_counter() - prepared)
        log.info("router.experts_rebalanced", epoch=epoch, balancedness_before=round(old.balancedness, 4),
                 balancedness_after=round(after, 4), bytes_moved=response.bytes_moved,
                 slots_changed=response.slots_changed, prepare_s=round(response.prepare_seconds, 4),
                 commit_s=round(response.commit_seconds, 4))
        return response

    # ---- the automatic trigger -------------------------------------------------------------------------------
    def start(self) -> None:
        """With --eplb: rebalance every step_interval steps (a periodic look at the step count)."""
        if self.settings.enabled and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="eplb")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.check_interval_s)  # a periodic check, not a synchronization
            due = self.engine.num_steps - self._last_step >= self.settings.step_interval
            if not due or self._running or self.engine.scheduler.is_frozen or not self.is_expert_parallel:
                continue
            try:
                await self.rebalance()
            except (ExpertBalanceError, ExpertBalanceAborted) as exc:
                log.warning("router.eplb_rebalance_failed", error=str(exc))


def _describe(exc: BaseException) -> str:
    return describe_error(exc) if isinstance(exc, grpc.aio.AioRpcError) else f"{type(exc).__name__}: {exc}"
