"""Calibration: measure every candidate layout on the live stack, and the switches between them, then fit a Profile.

For each layout the controller switches the stack into it (the ordinary Reconfigure, so the switch itself is a
measured sample), then keeps n requests in flight (n in the plan's batch sizes) through the router, exactly as
clients would: n clients each send requests of random token ids back to back (ignore_eos), with prompt and output
lengths varied so that they drift apart and new prompts are prefilled between the others' decode steps, as in
serving. An earlier version sent each wave all at once, which ranked a one-worker layout below the pipelines when a
replay of real traffic found it the best: it missed how prefills interleave with decoding. The mean time between a
request's tokens is a decode sample at n in flight, the median TTFT a prefill sample. It ends by switching back to
the layout it found. Requests from real clients during a calibration share the steps, which shows as noise in
the samples (and slows those clients): calibrate at a quiet time, or at first start.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from services.contracts.step import WorkerTime
from services.controller.autopilot.profile import (
    DecodeSample,
    PrefillSample,
    Profile,
    SwitchSample,
    balanced_split,
    fit_layout,
    requests_held,
    worker_speeds,
)
from services.controller.staging import prepare_workers
from services.controller.status import OperationState
from services.model.tokenizer import Tokenizer
from services.router.contracts import EngineStats
from services.router.wire import stats_from_pb
from services.rpc.reconfig.v1 import router_pb2
from services.topology import Topology, place
from services.topology.balance import BALANCE_MIN_GAIN

log = structlog.get_logger(__name__)
Progress = Callable[[str, float], None]  # (what is happening, share done in [0, 1])
LOAD_ROUNDS = 3


@dataclass(frozen=True, slots=True)
class CalibrationPlan:
    layouts: tuple[str, ...]
    batch_sizes: tuple[int, ...] = (1, 4, 12)
    prompt_tokens: tuple[int, ...] = (32, 160)
    output_tokens: int = 16
    seed: int = 0
    rounds: int = LOAD_ROUNDS       # requests each client sends back to back (the first warms up)

    def __post_init__(self) -> None:
        if not self.layouts:
            raise ValueError("calibration needs at least one layout")
        if not self.batch_sizes or min(self.batch_sizes) < 1 or not self.prompt_tokens or min(self.prompt_tokens) < 1:
            raise ValueError("batch sizes and prompt lengths must be >= 1")
        if self.rounds < 1:
            raise ValueError("rounds must be >= 1")
        if self.output_tokens < 3:
            raise ValueError("output_tokens must be >= 3 (TPOT needs tokens after the first)")
        if len(set(self.batch_sizes)) < 2 and len(self.layouts) > 1:
            raise ValueError("the step model needs at least two batch sizes")

    @property
    def num_loads(self) -> int:
        return len(self.layouts) * len(self.batch_sizes) * len(self.prompt_tokens)


async def _one_request(router, metadata, prompt: list[int], output_tokens: int, timeout_s: float
                       ) -> tuple[float, list[float]]:
    """When it was sent and the times (monotonic) at which each of its tokens arrived."""
    request = router_pb2.GenerateRequest(request_id=f"calibrate-{uuid.uuid4().hex[:12]}", prompt_token_ids=prompt,
                                         max_tokens=output_tokens, ignore_eos=True)
    sent, times = time.monotonic(), []
    async for response in router.Generate(request, timeout=timeout_s, metadata=metadata):
        if response.finish_reason == "error":
            raise RuntimeError(f"a calibration request failed: {response.error}")
        times.extend([time.monotonic()] * len(response.token_ids))
    return sent, times


async def measure_load(router, metadata, layout: str, concurrency: int, prompt_tokens: int, output_tokens: int,
                       vocab_size: int, rng: random.Random, rounds: int = LOAD_ROUNDS, timeout_s: float = 300.0
                       ) -> tuple[DecodeSample, PrefillSample]:
    """`concurrency` clients each send `rounds` requests back to back, as serving sees them: prompt and output
    lengths vary by half around the given ones, so the clients drift apart and prefills land between the others'
    decode steps. The first round warms up and spreads them; the later ones are the samples: their mean TPOT at this
    many requests in flight, and their median TTFT (prefill under this load)."""
    def lengths(mean: int, floor: int) -> int:
        return rng.randint(max(floor, mean // 2), max(floor, mean * 3 // 2))

    plans = [[([rng.randrange(vocab_size) for _ in range(lengths(prompt_tokens, 1))], lengths(output_tokens, 3))
              for _ in range(rounds)] for _ in range(concurrency)]

    async def client(plan) -> list[tuple[int, float, list[float], int]]:  # (round, sent, token times, prompt)
        done = []
        for round_, (prompt, output) in enumerate(plan):
            sent, times = await _one_request(router, metadata, prompt, output, timeout_s)
            done.append((round_, sent, times, len(prompt)))
        return done

    finished = [r for c in await asyncio.gather(*(client(p) for p in plans)) for r in c]
    steady = [(sent, times, prompt) for round_, sent, times, prompt in finished if round_ >= min(1, rounds - 1)]
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for _, t, _ in steady if len(t) >= 2]
    if not tpots:
        raise RuntimeError("calibration requests produced fewer than two tokens")
    mean_prompt = sum(p for _, _, p in steady) / len(steady)
    context = mean_prompt + sum(len(t) for _, t, _ in steady) / len(steady) / 2
    ttft = statistics.median(t[0] - sent for sent, t, _ in steady if t)
    return (DecodeSample(layout, concurrency, context, sum(tpots) / len(tpots)),
            PrefillSample(layout, round(mean_prompt), ttft))


def prompt_vocabulary(reconfigurer) -> int:
    """Token ids a measuring prompt may use: the router accepts the tokenizer's, the model may have more rows."""
    size = reconfigurer.spec.vocab_size
    model_dir = reconfigurer.state.config.model_dir
    return min(size, Tokenizer.from_dir(model_dir).vocab_size) if model_dir else size


async def calibrate(reconfigurer, plan: CalibrationPlan, model: str, machine: str,
                    progress: Progress | None = None) -> Profile:
    """Measure each layout of `plan` on the live stack (switching through them) and fit a Profile; the stack ends
    in the layout it started in. Raises RuntimeError when a switch fails (the stack stays in a working layout)."""
    for layout in plan.layouts:
        reconfigurer.target(layout)  # TopologyError before anything moves
    return await _Calibration(reconfigurer, plan, progress).run(model, machine)


class _Calibration:
    """One calibration's measurements (owned by `calibrate`)."""

    def __init__(self, reconfigurer, plan: CalibrationPlan, progress: Progress | None) -> None:
        self.reconfigurer, self.plan = reconfigurer, plan
        self.report = progress or (lambda what, done: None)
        self.vocab = prompt_vocabulary(reconfigurer)
        self.switches: dict[tuple[str, str], SwitchSample] = {}
        self.timed: dict[str, list[tuple[int, int, float, float, int]]] = {}  # pipeline layouts: workers' own time
        self.partitions: dict[str, tuple[int, ...]] = {}
        self.trials: list[tuple[str, tuple[int, ...], float, float, bool]] = []
        self.done = 0

    async def run(self, model: str, machine: str) -> Profile:
        reconfigurer, plan = self.reconfigurer, self.plan
        start = (str(reconfigurer.state.topology), reconfigurer.state.layer_partition)
        # Workers are timed one by one on CPU only: on a GPU the host sees only the kernel launches.
        devices = [w.device for w in (await reconfigurer.state.refresh()).workers]
        cpu_workers = bool(devices) and all(d.startswith("cpu") for d in devices)
        decode: list[DecodeSample] = []
        prefill: list[PrefillSample] = []
        capacity: dict[str, tuple[int, int, int, int]] = {}
        for layout in plan.layouts:
            await self.switch_to(layout)
            target = reconfigurer.target(layout)
            topology = target.topology
            prepared, blocks = await prepare_workers(reconfigurer.workers, target, reconfigurer.rpc_timeout_s,
                                                     reconfigurer.metadata)
            capacity[layout] = (blocks, prepared[0].block_size, topology.num_workers, topology.num_kv_pools)
            before = await worker_times(reconfigurer)
            d, p = await self.loads(layout, blocks * topology.num_kv_pools, prepared[0].block_size)
            if cpu_workers and measures_speed(topology):
                self.timed[layout] = self.worker_rows(topology, before, await worker_times(reconfigurer))
                d, p = await self.try_balanced(layout, d, p, blocks * topology.num_kv_pools,
                                               prepared[0].block_size)
            decode += d
            prefill += p
        await self.switch_to(*start)
        self.report("fitting", 1.0)
        layouts = {name: fit_layout(name, decode, prefill, *capacity[name]) for name in plan.layouts}
        return Profile(model=model, machine=machine, layouts=layouts, switches=self.switches,
                       decode_samples=tuple(decode), prefill_samples=tuple(prefill), created_unix_s=time.time(),
                       num_layers=reconfigurer.spec.shape.num_layers, worker_speeds=worker_speeds(self.timed),
                       partitions=self.partitions, split_trials=tuple(self.trials))

    async def switch_to(self, layout: str, partition: tuple[int, ...] | None = None) -> None:
        state = self.reconfigurer.state
        live = str(state.topology)
        if Topology.parse(layout) == state.topology and partition == state.layer_partition:
            return
        self.report(f"switching {live} -> {layout}", self.share_done)
        op = await self.reconfigurer.reconfigure(layout, operation_id=f"calibrate-{uuid.uuid4().hex[:8]}",
                                                 layer_partition=partition or ())
        if op.state is not OperationState.SUCCEEDED:
            raise RuntimeError(f"calibration switch {live} -> {layout} failed: {op.error}")
        if Topology.parse(live) != Topology.parse(layout):
            self.switches[(live, layout)] = SwitchSample(live, layout, op.downtime_seconds, op.staging_seconds)

    @property
    def share_done(self) -> float:
        return min(1.0, self.done / self.plan.num_loads)

    async def loads(self, layout: str, kv_blocks: int, block_size: int
                    ) -> tuple[list[DecodeSample], list[PrefillSample]]:
        """Every load of the plan in the live layout, the same prompts for a layout every time (seeded by it). A
        load past what the layout's KV holds is measured at what it holds: past it requests queue or are preempted,
        which the profile counts apart (LayoutModel.effective_tpot), not in the step model."""
        rng = random.Random(f"{self.plan.seed}:{layout}")
        decode, prefill = [], []
        for prompt in self.plan.prompt_tokens:
            longest = (prompt + self.plan.output_tokens) * 3 // 2          # lengths vary up to 1.5x
            held = max(1, requests_held(kv_blocks, block_size, longest))
            for batch in sorted({min(b, held) for b in self.plan.batch_sizes}):
                self.report(f"{layout}: {batch} requests of {prompt} tokens", self.share_done)
                d, p = await measure_load(self.reconfigurer.router, self.reconfigurer.metadata, layout, batch, prompt,
                                          self.plan.output_tokens, self.vocab, rng, self.plan.rounds)
                decode.append(d)
                prefill.append(p)
                self.done += 1
                log.info("autopilot.calibrate_load", layout=layout, batch=batch, prompt=prompt,
                         tpot_ms=round(d.tpot_s * 1e3, 2), ttft_ms=round(p.seconds * 1e3, 1))
        return decode, prefill

    def worker_rows(self, topology: Topology, before: dict[int, WorkerTime],
                    after: dict[int, WorkerTime]) -> list[tuple[int, int, float, float, int]]:
        """(rank, layers held, forward s, head s, steps) of each worker over the loads just run."""
        placement = place(topology, self.reconfigurer.spec.shape)
        return [(w.rank, len(placement.workers[w.rank].layers), w.forward_seconds - was.forward_seconds,
                 w.head_seconds - was.head_seconds, w.steps - was.steps)
                for w in after.values() if (was := before.get(w.rank, WorkerTime(w.rank)))]

    async def try_balanced(self, layout: str, decode: list[DecodeSample], prefill: list[PrefillSample],
                           kv_blocks: int, block_size: int) -> tuple[list[DecodeSample], list[PrefillSample]]:
        """A pipeline layout whose workers' speeds call for another split: measure it with the same loads and keep
        it (and its samples) only if it is really faster; the model assumes stages run side by side, which workers
        sharing cores do not."""
        split = balanced_split(worker_speeds(self.timed), self.reconfigurer.spec.shape.num_layers, layout)
        if split is None:
            return decode, prefill
        await self.switch_to(layout, split)
        split_decode, split_prefill = await self.loads(layout, kv_blocks, block_size)
        even_s, split_s = sum(d.tpot_s for d in decode), sum(d.tpot_s for d in split_decode)
        kept = split_s < (1 - BALANCE_MIN_GAIN) * even_s
        self.trials.append((layout, split, even_s, split_s, kept))
        log.info("autopilot.calibrate_split", layout=layout, split=list(split), kept=kept,
                 tpot_even_ms=round(even_s * 1e3, 1), tpot_split_ms=round(split_s * 1e3, 1))
        if not kept:  # the next layout's switch (or the final one back) leaves the split either way
            return decode, prefill
        self.partitions[layout] = split
        return split_decode, split_prefill


async def router_stats(reconfigurer) -> EngineStats:
    """The router's Stats now, in the contract's form."""
    return stats_from_pb(await reconfigurer.router.Stats(router_pb2.StatsRequest(), timeout=reconfigurer.rpc_timeout_s,
                                                         metadata=reconfigurer.metadata))


async def worker_times(reconfigurer) -> dict[int, WorkerTime]:
    """The router's per-worker model time now (cumulative since it connected to the live layout's workers)."""
    return {w.rank: w for w in (await router_stats(reconfigurer)).worker_time}


def measures_speed(topology: Topology) -> bool:
    """Whether a layout's steps time each worker on its own: one worker per stage (no TP collective waits on the
    slowest peer), two stages or more."""
    return topology.pp >= 2 and topology.num_workers == topology.pp
