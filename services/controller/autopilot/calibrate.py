"""Calibration: measure every candidate layout on the live stack, and the switches between them, then fit a Profile.

For each layout the controller switches the stack into it (the ordinary Reconfigure, so the switch itself is a
measured sample), then sends waves of `batch` concurrent requests of `prompt` random token ids that each generate
`output` tokens (ignore_eos) through the router, exactly as clients would: TTFT of the wave is a prefill sample, the
median time between a request's tokens a decode sample at that batch and mean context. It ends by switching back
to the layout it found. Requests from real clients during a calibration share the steps, which shows as noise in
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

from services.controller.autopilot.profile import (
    DecodeSample,
    PrefillSample,
    Profile,
    SwitchSample,
    fit_layout,
)
from services.controller.staging import prepare_workers
from services.controller.status import OperationState
from services.model.tokenizer import Tokenizer
from services.rpc.reconfig.v1 import router_pb2
from services.topology import Topology

log = structlog.get_logger(__name__)
Progress = Callable[[str, float], None]  # (what is happening, share done in [0, 1])


@dataclass(frozen=True, slots=True)
class CalibrationPlan:
    layouts: tuple[str, ...]
    batch_sizes: tuple[int, ...] = (1, 4, 12)
    prompt_tokens: tuple[int, ...] = (32, 160)
    output_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.layouts:
            raise ValueError("calibration needs at least one layout")
        if not self.batch_sizes or min(self.batch_sizes) < 1 or not self.prompt_tokens or min(self.prompt_tokens) < 1:
            raise ValueError("batch sizes and prompt lengths must be >= 1")
        if self.output_tokens < 3:
            raise ValueError("output_tokens must be >= 3 (TPOT needs tokens after the first)")
        if len(set(self.batch_sizes)) < 2 and len(self.layouts) > 1:
            raise ValueError("the step model needs at least two batch sizes")

    @property
    def num_waves(self) -> int:
        return len(self.layouts) * len(self.batch_sizes) * len(self.prompt_tokens)


async def _one_request(router, metadata, prompt: list[int], output_tokens: int, timeout_s: float) -> list[float]:
    """Times (monotonic) at which each token arrived."""
    request = router_pb2.GenerateRequest(request_id=f"calibrate-{uuid.uuid4().hex[:12]}", prompt_token_ids=prompt,
                                         max_tokens=output_tokens, ignore_eos=True)
    times: list[float] = []
    async for response in router.Generate(request, timeout=timeout_s, metadata=metadata):
        if response.finish_reason == "error":
            raise RuntimeError(f"a calibration request failed: {response.error}")
        times.extend([time.monotonic()] * len(response.token_ids))
    return times


async def measure_wave(router, metadata, layout: str, batch: int, prompt_tokens: int, output_tokens: int,
                       vocab_size: int, rng: random.Random, timeout_s: float = 300.0
                       ) -> tuple[DecodeSample, PrefillSample]:
    """`batch` requests at once; their median TPOT and the wave's slowest TTFT."""
    prompts = [[rng.randrange(vocab_size) for _ in range(prompt_tokens)] for _ in range(batch)]
    start = time.monotonic()
    waves = await asyncio.gather(*(_one_request(router, metadata, p, output_tokens, timeout_s) for p in prompts))
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in waves if len(t) >= 2]
    if not tpots:
        raise RuntimeError("calibration requests produced fewer than two tokens")
    ttft = max(t[0] for t in waves if t) - start
    context = prompt_tokens + output_tokens / 2
    return (DecodeSample(layout, batch, context, statistics.median(tpots)),
            PrefillSample(layout, batch * prompt_tokens, ttft))


def prompt_vocabulary(reconfigurer) -> int:
    """Token ids a measuring prompt may use: the router accepts the tokenizer's, the model may have more rows."""
    size = reconfigurer.spec.vocab_size
    model_dir = reconfigurer.state.config.model_dir
    return min(size, Tokenizer.from_dir(model_dir).vocab_size) if model_dir else size


async def calibrate(reconfigurer, plan: CalibrationPlan, model: str, machine: str,
                    progress: Progress | None = None) -> Profile:
    """Measure each layout of `plan` on the live stack (switching through them) and fit a Profile; the stack ends
    in the layout it started in. Raises RuntimeError when a switch fails (the stack stays in a working layout)."""
    report = progress or (lambda what, done: None)
    router, metadata = reconfigurer.router, reconfigurer.metadata
    vocab = prompt_vocabulary(reconfigurer)
    rng = random.Random(plan.seed)
    start_layout = str(reconfigurer.state.topology)
    for layout in plan.layouts:
        reconfigurer.target(layout)  # TopologyError before anything moves
    decode: list[DecodeSample] = []
    prefill: list[PrefillSample] = []
    switches: dict[tuple[str, str], SwitchSample] = {}
    capacity: dict[str, tuple[int, int, int, int]] = {}
    done = 0

    async def switch_to(layout: str) -> None:
        live = str(reconfigurer.state.topology)
        if Topology.parse(layout) == Topology.parse(live):
            return
        report(f"switching {live} -> {layout}", done / plan.num_waves)
        op = await reconfigurer.reconfigure(layout, operation_id=f"calibrate-{uuid.uuid4().hex[:8]}")
        if op.state is not OperationState.SUCCEEDED:
            raise RuntimeError(f"calibration switch {live} -> {layout} failed: {op.error}")
        switches[(live, layout)] = SwitchSample(live, layout, op.downtime_seconds, op.staging_seconds)

    for layout in plan.layouts:
        await switch_to(layout)
        for prompt in plan.prompt_tokens:
            for batch in plan.batch_sizes:
                report(f"{layout}: {batch} requests of {prompt} tokens", done / plan.num_waves)
                d, p = await measure_wave(router, metadata, layout, batch, prompt, plan.output_tokens, vocab, rng)
                decode.append(d)
                prefill.append(p)
                done += 1
                log.info("autopilot.calibrate_wave", layout=layout, batch=batch, prompt=prompt,
                         tpot_ms=round(d.tpot_s * 1e3, 2), ttft_ms=round(p.seconds * 1e3, 1))
        target = reconfigurer.target(layout)
        prepared, blocks = await prepare_workers(reconfigurer.workers, target, reconfigurer.rpc_timeout_s, metadata)
        capacity[layout] = (blocks, prepared[0].block_size, target.topology.num_workers, target.topology.num_kv_pools)
    await switch_to(start_layout)
    report("fitting", 1.0)
    layouts = {name: fit_layout(name, decode, prefill, *capacity[name]) for name in plan.layouts}
    return Profile(model=model, machine=machine, layouts=layouts, switches=switches, decode_samples=tuple(decode),
                   prefill_samples=tuple(prefill), created_unix_s=time.time())
