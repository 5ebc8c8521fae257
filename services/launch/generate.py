"""Offline batch generation over a Driver: admit prompts while KV blocks last, prefill, decode until done.

A deliberately small loop for the CLI, tests and benchmarks; the router's scheduler does continuous batching
with preemption for serving.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.contracts.step import GREEDY, SamplingParams, SequenceStep
from services.router.block_manager import num_blocks_for
from services.router.driver import Driver


@dataclass(slots=True)
class Generation:
    """A prompt's generated tokens (and per-step logits when asked for)."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)
    finish_reason: str = ""


@dataclass(slots=True)
class _Running:
    index: int
    blocks: list[int]
    dp_rank: int = 0  # EP layouts: the data-parallel rank whose KV pool holds the blocks
    cached: int = 0  # tokens whose KV is in the cache


async def generate(driver: Driver, prompts: list[list[int]], max_tokens: int, sampling: SamplingParams = GREEDY,
                   stop_token_ids: frozenset[int] = frozenset(), return_logits: bool = False) -> list[Generation]:
    """Generate up to `max_tokens` per prompt; stops early at a stop token. Results in input order."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    # One pool of block ids per data-parallel rank (one outside EP layouts); each request lives in one pool.
    block_size = driver.block_size
    pools = [list(range(driver.num_kv_blocks - 1, -1, -1)) for _ in range(driver.dp_size)]
    results = [Generation(list(p)) for p in prompts]
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        if num_blocks_for(len(prompt) + max_tokens, block_size) > driver.num_kv_blocks:
            raise ValueError(f"prompt {i} needs more KV blocks than the workers have ({driver.num_kv_blocks})")
    waiting, running = list(range(len(prompts))), []
    while waiting or running:
        # Admit in order while each admitted request's whole KV fits (no preemption needed in this loop).
        while waiting:
            need = num_blocks_for(len(prompts[waiting[0]]) + max_tokens, block_size)
            rank = max(range(len(pools)), key=lambda r: (len(pools[r]), -r))  # the emptiest pool, lowest rank
            if need > len(pools[rank]):
                break
            running.append(_Running(waiting.pop(0), [pools[rank].pop() for _ in range(need)], rank))
        steps = []
        for seq in running:
            gen = results[seq.index]
            new = gen.prompt_token_ids if seq.cached == 0 else gen.token_ids[-1:]
            steps.append((seq, SequenceStep(
                request_id=str(seq.index), token_ids=tuple(new), start_position=seq.cached,
                block_table=tuple(seq.blocks), sampling=sampling, return_logits=return_logits,
                num_generated=len(gen.token_ids), dp_rank=seq.dp_rank,
            )))
        output = await driver.step([s for _, s in steps])
        by_id = {o.request_id: o for o in output.outputs}
        for seq, step in steps:
            gen, out = results[seq.index], by_id[step.request_id]
            seq.cached += len(step.token_ids)
            gen.token_ids.append(out.token_id)
            if return_logits:
                gen.logits.append(np.frombuffer(out.logits, dtype=np.float32))
            if out.token_id in stop_token_ids:
                gen.finish_reason = "stop"
            elif len(gen.token_ids) >= max_tokens:
                gen.finish_reason = "length"
        for seq in [s for s in running if results[s.index].finish_reason]:
            running.remove(seq)
            pools[seq.dp_rank].extend(seq.blocks)
    return results
