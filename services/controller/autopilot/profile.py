"""Measured layout profiles: what each layout costs per decode step and per prompt token, what it holds, and what a
switch between two layouts costs; fitted from samples that `calibrate` measures on the live stack.

A decode step of a layout that runs `n` requests of mean context `c` takes  a + n·(b + c·g)  seconds (every running
request gets one token per step, so that is also each request's TPOT): a fixed cost per step (launches, collectives,
pipeline hand-offs, the router's turn), a cost per request (its row of every matmul) and a cost per cached position
it attends over. The first token of a `p`-token prompt comes after  p0 + p·p1  (its prefill, and the other requests'
steps it waits behind at the calibrated loads). Both are fitted by non-negative least squares, so
a noisy sample cannot make a cost negative. Because TPOT is linear in `n` for a given context, two layouts cross at
most once: the crossover is the load at which the better layout changes, which is where the policy's thresholds
come from (no hand-set T_h).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from services.model.cache import default_cache_dir
from services.topology import Topology
from services.topology.balance import BALANCE_MIN_GAIN, balanced_partition, slowest_stage_s
from services.topology.placement import layer_partition

PROFILE_VERSION = 1


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """`batch` requests decoding together at a mean context of `context` tokens took `tpot_s` per token each."""

    layout: str
    batch: int
    context: float
    tpot_s: float


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """Requests of `tokens` prompt tokens (mean) saw their first token after `seconds` (median), at the load the
    calibration held: their prefill, and the steps of the others they waited behind."""

    layout: str
    tokens: int
    seconds: float


@dataclass(frozen=True, slots=True)
class SwitchSample:
    """A measured switch: the freeze (what requests in flight wait) and the staging before it (served slower)."""

    source: str
    target: str
    downtime_s: float
    staging_s: float = 0.0


@dataclass(frozen=True, slots=True)
class WorkerSpeed:
    """How fast one worker ran its part of the calibration's steps (CPU workers; measured in pipeline layouts)."""

    rank: int
    layer_s: float           # seconds per layer per step
    head_ratio: float = 0.0  # a last stage's head (norm, lm_head, sampling) per step, in layers' worth


@dataclass(frozen=True, slots=True)
class LayoutModel:
    """One layout's fitted costs and capacity."""

    layout: str
    step_s: float            # a: fixed cost of a decode step
    per_request_s: float     # b: each running request's share of a step
    per_position_s: float    # g: each cached position a request attends over
    prefill_base_s: float    # p0
    prefill_per_token_s: float  # p1
    kv_blocks: int           # KV capacity in blocks (per data-parallel rank for EP layouts)
    block_size: int          # tokens per block
    num_workers: int         # active workers (the "cost" of the layout)
    kv_pools: int = 1        # data-parallel attention ranks, each with its own pool of kv_blocks

    def tpot(self, batch: float, context: float) -> float:
        """Seconds per token of each of `batch` requests decoding at mean context `context`."""
        return self.step_s + max(batch, 1.0) * self.slope(context)

    def slope(self, context: float) -> float:
        """How much TPOT grows per extra running request at this context."""
        return self.per_request_s + max(context, 0.0) * self.per_position_s

    def effective_tpot(self, load: float, context: float) -> float:
        """Seconds per token each of `load` requests in flight sees over time: past what the KV holds, requests
        take turns (the ones waiting get no tokens), so the layout's token rate is shared among all of them."""
        held = max(1, self.max_requests(context))
        if load <= held:
            return self.tpot(load, context)
        return self.tpot(held, context) * load / held

    def throughput(self, batch: float, context: float) -> float:
        """Tokens per second the layout generates with `batch` requests running."""
        return max(batch, 1.0) / self.tpot(batch, context)

    def settle(self, rate: float, prompt: float, output: float) -> tuple[float, float]:
        """(Requests in flight, TPOT) this layout settles at under `rate` arrivals/s of `prompt`-token prompts and
        `output`-token answers: Little's law on the step model, with decode stretched by the share of time the
        arrivals' prefills hold the stack (the calibration measures decode steps without prefills between them).
        A layout that cannot keep up has an infinite load; its TPOT is then that of the requests its KV holds (the
        others wait, which shows in their TTFT)."""
        prefill, context = self.prefill(prompt), prompt + output / 2
        busy = max(rate, 0.0) * prefill
        if busy >= 1:
            return math.inf, math.inf
        # load -> the load its arrivals keep in flight is increasing (a longer TPOT holds requests longer), so from
        # below the plain iteration climbs to the smallest fixed point; near saturation it climbs by a factor close
        # to 1 a step (at 98% utilization the old 1000 damped steps stopped ~470 requests short and said "cannot
        # keep up"), hence the long budget and the tight stop.
        load = busy
        for _ in range(20000):
            new_load = rate * (prefill + max(output - 1, 0.0) * self.effective_tpot(load, context) / (1 - busy))
            if abs(new_load - load) < 1e-9 * max(load, 1.0):
                return new_load, self.effective_tpot(new_load, context) / (1 - busy)
            if new_load > 1e4:
                break
            load = new_load
        return math.inf, self.tpot(max(1, self.max_requests(context)), context) / (1 - busy)

    def prefill(self, tokens: float) -> float:
        return self.prefill_base_s + max(tokens, 0.0) * self.prefill_per_token_s

    def max_requests(self, context: float) -> int:
        """How many requests of `context` tokens its KV cache holds at once."""
        return requests_held(self.kv_blocks, self.block_size, context) * self.kv_pools

    def holds(self, used_blocks: int) -> bool:
        """Whether the blocks in use now fit (the KV capacity check of a target)."""
        return used_blocks <= self.kv_blocks * self.kv_pools


def poisson_quantile(mean: float, q: float) -> int:
    """The smallest k with P(X <= k) >= q for X ~ Poisson(mean): requests arriving at random and staying
    independently (an M/G/inf system) are in flight Poisson(rate x mean stay) many at a time, so a pool sized to the
    mean alone is short about half the time. inf for an infinite mean."""
    if math.isinf(mean):
        return math.inf  # type: ignore[return-value]
    if mean <= 0:
        return 0
    # Term by term in logs (exp(-mean) alone underflows past a mean of ~700), from 12 standard deviations below the
    # mean (what lies below is under 1e-30 of the mass).
    k = max(0, math.floor(mean - 12 * math.sqrt(mean)))
    total, log_mean = 0.0, math.log(mean)
    while True:
        total += math.exp(k * log_mean - mean - math.lgamma(k + 1))
        if total >= q or k > mean + 50 * math.sqrt(mean) + 50:
            return k
        k += 1


def requests_held(kv_blocks: int, block_size: int, tokens: float) -> int:
    """How many requests of `tokens` tokens a pool of `kv_blocks` blocks holds at once."""
    return kv_blocks // max(1, math.ceil(max(tokens, 1.0) / max(block_size, 1)))


def crossover(a: LayoutModel, b: LayoutModel, context: float, margin: float = 0.0) -> float | None:
    """The load (running requests) above which `b`'s TPOT is at most (1 - margin) of `a`'s at this context; None
    when `b` does not gain on `a` as the load grows (then see `crossunder`)."""
    keep = 1.0 - margin
    slope_gap = keep * a.slope(context) - b.slope(context)
    if slope_gap <= 0:
        return None
    return max((b.step_s - keep * a.step_s) / slope_gap, 0.0)


def crossunder(a: LayoutModel, b: LayoutModel, context: float, margin: float = 0.0) -> float | None:
    """The load below which `b`'s TPOT is at most (1 - margin) of `a`'s (b is the low-load layout); None when `b`
    does not lose ground to `a` as the load grows, or is never that much better."""
    keep = 1.0 - margin
    slope_gap = b.slope(context) - keep * a.slope(context)
    if slope_gap <= 0:
        return None
    below = (keep * a.step_s - b.step_s) / slope_gap
    return below if below > 0 else None


@dataclass(frozen=True, slots=True)
class Band:
    """Loads [low, high) (running requests) where `layout` has the lowest TPOT of the candidates."""

    low: float
    high: float
    layout: str


@dataclass(frozen=True)
class Profile:
    """Every calibrated layout of one model on one machine, and the measured switches between them."""

    model: str
    machine: str
    layouts: dict[str, LayoutModel]
    switches: dict[tuple[str, str], SwitchSample] = field(default_factory=dict)
    decode_samples: tuple[DecodeSample, ...] = ()
    prefill_samples: tuple[PrefillSample, ...] = ()
    created_unix_s: float = 0.0
    num_layers: int = 0
    worker_speeds: tuple[WorkerSpeed, ...] = ()  # empty: not measured (GPU workers, or no pipeline layout)
    partitions: dict[str, tuple[int, ...]] = field(default_factory=dict)  # verified splits by measured speed
    # Each split the calibration tried: (layout, split, sum of the loads' TPOT even, with the split, kept).
    split_trials: tuple[tuple[str, tuple[int, ...], float, float, bool], ...] = ()

    def layer_partition(self, layout: str) -> tuple[int, ...] | None:
        """The layers per stage the calibration measured faster than the even split for this layout, or None."""
        return self.partitions.get(layout)

    def best(self, load: float, context: float, allowed: Iterable[str] | None = None) -> str:
        """The layout with the lowest TPOT at this load among `allowed` that hold it (ties: fewer workers)."""
        names = list(allowed) if allowed is not None else list(self.layouts)
        fitting = [n for n in names if self.layouts[n].max_requests(context) >= load] or names
        return min(fitting, key=lambda n: (self.layouts[n].tpot(load, context), self.layouts[n].num_workers, n))

    def bands(self, context: float, max_load: int, allowed: Iterable[str] | None = None) -> list[Band]:
        """Where each layout is best, from 1 to max_load running requests: the measured thresholds."""
        names = list(allowed) if allowed is not None else list(self.layouts)
        bands: list[Band] = []
        for load in range(1, max_load + 1):
            best = self.best(load, context, names)
            if bands and bands[-1].layout == best:
                bands[-1] = Band(bands[-1].low, load + 1, best)
            else:
                bands.append(Band(load, load + 1, best))
        return bands

    def switch_cost(self, source: str, target: str) -> SwitchSample:
        """The measured switch, else the slowest measured one into `target`, else the slowest of all (a switch
        never measured is not assumed cheap)."""
        if (source, target) in self.switches:
            return self.switches[(source, target)]
        into = [s for (_, t), s in self.switches.items() if t == target] or list(self.switches.values())
        if not into:
            return SwitchSample(source, target, downtime_s=1.0, staging_s=10.0)
        return SwitchSample(source, target, max(s.downtime_s for s in into), max(s.staging_s for s in into))

    # ---- persistence ---------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "version": PROFILE_VERSION, "model": self.model, "machine": self.machine,
            "created_unix_s": self.created_unix_s,
            "layouts": {name: dataclasses.asdict(m) for name, m in self.layouts.items()},
            "switches": [dataclasses.asdict(s) for s in self.switches.values()],
            "decode_samples": [dataclasses.asdict(s) for s in self.decode_samples],
            "prefill_samples": [dataclasses.asdict(s) for s in self.prefill_samples],
            "num_layers": self.num_layers,
            "worker_speeds": [dataclasses.asdict(w) for w in self.worker_speeds],
            "partitions": {layout: list(split) for layout, split in self.partitions.items()},
            "split_trials": [[layout, list(split), even, trial, kept]
                             for layout, split, even, trial, kept in self.split_trials],
        }

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {data.get('version')!r} is not {PROFILE_VERSION}: recalibrate")
        switches = [SwitchSample(**s) for s in data.get("switches", [])]
        return cls(
            model=data["model"], machine=data["machine"], created_unix_s=float(data.get("created_unix_s", 0.0)),
            layouts={name: LayoutModel(**m) for name, m in data["layouts"].items()},
            switches={(s.source, s.target): s for s in switches},
            decode_samples=tuple(DecodeSample(**s) for s in data.get("decode_samples", [])),
            prefill_samples=tuple(PrefillSample(**s) for s in data.get("prefill_samples", [])),
            num_layers=int(data.get("num_layers", 0)),
            worker_speeds=tuple(WorkerSpeed(**w) for w in data.get("worker_speeds", [])),
            partitions={layout: tuple(split) for layout, split in data.get("partitions", {}).items()},
            split_trials=tuple((layout, tuple(split), even, trial, kept)
                               for layout, split, even, trial, kept in data.get("split_trials", [])),
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Profile:
        return cls.from_json(json.loads(Path(path).read_text()))


def fit_layout(layout: str, decode: Sequence[DecodeSample], prefill: Sequence[PrefillSample], kv_blocks: int,
               block_size: int, num_workers: int, kv_pools: int = 1) -> LayoutModel:
    """Non-negative least squares of the step model over one layout's samples (ValueError without decode ones)."""
    from scipy.optimize import nnls  # here: only calibration fits (the GPU image has no scipy)

    rows = [s for s in decode if s.layout == layout]
    if not rows:
        raise ValueError(f"no decode samples for {layout}")
    features = np.array([[1.0, s.batch, s.batch * s.context] for s in rows])
    (step, per_request, per_position), _ = nnls(features, np.array([s.tpot_s for s in rows]))
    fills = [s for s in prefill if s.layout == layout]
    if len(fills) >= 2:
        (base, per_token), _ = nnls(np.array([[1.0, s.tokens] for s in fills]), np.array([s.seconds for s in fills]))
    elif fills:
        base, per_token = 0.0, fills[0].seconds / max(fills[0].tokens, 1)
    else:
        base, per_token = 0.0, 0.0
    return LayoutModel(layout, float(step), float(per_request), float(per_position), float(base), float(per_token),
                       kv_blocks, block_size, num_workers, kv_pools)


def worker_speeds(samples: Mapping[str, Sequence[tuple[int, int, float, float, int]]]) -> tuple[WorkerSpeed, ...]:
    """Per worker, from the pipeline layouts' measurements {layout: [(rank, layers held, forward s, head s,
    steps)]}: seconds per layer from the layout with the most stages that ran it, and a last stage's head cost in
    layers' worth (the mean over the layouts where it was last)."""
    finest: dict[int, tuple[int, float]] = {}     # rank -> (stages of the layout it came from, s per layer)
    heads: dict[int, list[float]] = {}
    for layout, rows in samples.items():
        stages = Topology.parse(layout).pp
        for rank, layers, forward_s, head_s, steps in rows:
            if steps <= 0 or layers <= 0 or forward_s <= 0:
                continue
            per_layer = forward_s / steps / layers
            if rank not in finest or stages > finest[rank][0]:
                finest[rank] = (stages, per_layer)
            if head_s > 0:
                heads.setdefault(rank, []).append(head_s / steps / per_layer)
    return tuple(WorkerSpeed(rank, finest[rank][1], sum(heads.get(rank, [0.0])) / len(heads.get(rank, [0.0])))
                 for rank in sorted(finest))


def balanced_split(speeds: Sequence[WorkerSpeed], num_layers: int, layout: str) -> tuple[int, ...] | None:
    """Layers per stage in proportion to the workers' measured speed (a stage runs at its slowest worker's pace, the
    last one also pays the head), when the model says the slowest stage gets at least BALANCE_MIN_GAIN faster than
    with the even split; None otherwise, or without a speed for every worker of the layout. A proposal: the
    calibration measures it before the profile adopts it (stages that share cores do not run side by side)."""
    topology = Topology.parse(layout)
    by_rank = {w.rank: w for w in speeds}
    width = topology.num_workers // topology.pp
    ranks = [[stage * width + i for i in range(width)] for stage in range(topology.pp)]
    if topology.pp < 2 or num_layers < topology.pp or not all(r in by_rank for stage in ranks for r in stage):
        return None
    per_layer = [max(by_rank[r].layer_s for r in stage) for stage in ranks]
    head = max((w.head_ratio for w in speeds), default=0.0)
    fixed = [0.0] * (topology.pp - 1) + [head * per_layer[-1]]
    split = balanced_partition(per_layer, num_layers, fixed)
    even = tuple(len(r) for r in layer_partition(num_layers, topology.pp))
    if slowest_stage_s(split, per_layer, fixed) > (1 - BALANCE_MIN_GAIN) * slowest_stage_s(even, per_layer, fixed):
        return None
    return split


def machine_key(device: str = "cpu", num_workers: int = 0, threads_per_worker: int = 0) -> str:
    """What makes a profile valid only on this kind of machine: CPU model and count (or the GPU), and how many
    workers with how many threads share it."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{cpu}|{os.cpu_count()}|{device}|{num_workers}|{threads_per_worker}"
    return f"{platform.machine()}-{os.cpu_count()}c-{hashlib.sha1(text.encode()).hexdigest()[:10]}"


def profile_path(model: str, machine: str, root: Path | None = None) -> Path:
    """Where the profile of this model on this machine is cached (beside the models: $RECONFIG_CACHE_DIR, ...)."""
    base = root or default_cache_dir()
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in model)
    return base / "profiles" / f"{safe}__{machine}.json"
