"""The operations a workload causes: allocate at arrival, update at every new KV block, depart at the end."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.simulator.trace import Workload

DEPART, UPDATE, ALLOCATE = 0, 1, 2  # at equal times: departs, then updates, then allocates


@dataclass(frozen=True, slots=True)
class InstanceProfile:
    """The model and instance the simulation assumes (defaults: Llama-2-7B fp16 on a 24 GB GPU)."""

    kv_capacity_tokens: int = 16384
    kv_bytes_per_token: int = 524288  # 2 (K, V) * 32 layers * 4096 hidden * 2 bytes
    decode_tokens_per_s: float = 25.0  # per request, in a continuous batch
    prefill_tokens_per_s: float = 4000.0
    block_size: int = 16
    link_bytes_per_s: float = 25e9  # KV transfer bandwidth of one instance-to-instance link

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens < self.block_size or self.block_size < 1:
            raise ValueError("need 1 <= block_size <= kv_capacity_tokens")
        if min(self.kv_bytes_per_token, self.decode_tokens_per_s, self.prefill_tokens_per_s,
               self.link_bytes_per_s) <= 0:
            raise ValueError("profile rates and sizes must be > 0")


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """Each request's own speed instead of the profile's (a replay of measured requests): when its decode starts
    (its first token is due 1 / rate after) and its decode rate, one entry per workload request."""

    decode_start_s: np.ndarray
    decode_tokens_per_s: np.ndarray

    def __post_init__(self) -> None:
        if len(self.decode_start_s) != len(self.decode_tokens_per_s) or not np.all(self.decode_tokens_per_s > 0):
            raise ValueError("need one decode start and one rate > 0 per request")


@dataclass(frozen=True, slots=True)
class Events:
    """Every operation a workload causes, in time order, as parallel lists (fast to iterate)."""

    time_s: list[float]
    kind: list[int]
    request: list[int]  # index into the workload
    kv_tokens: list[int]  # KV tokens after the operation (allocate, update); 0 for departs
    num_admitted: int
    num_rejected: int  # requests whose final KV exceeds one instance's capacity


def build_events(workload: Workload, profile: InstanceProfile, timing: RequestTiming | None = None) -> Events:
    """Allocate at arrival, update at every new KV block, depart at the last token. timing: each request decodes
    from its own start at its own rate (never before its arrival), not at the profile's rates."""
    block = profile.block_size
    prompt, output = workload.prompt_tokens, workload.output_tokens
    if timing is not None and len(timing.decode_start_s) != len(workload):
        raise ValueError(f"{len(timing.decode_start_s)} request timings for {len(workload)} requests")
    admitted = -(-(prompt + output) // block) * block <= profile.kv_capacity_tokens
    index = np.nonzero(admitted)[0]
    prompt, output, arrival = prompt[index], output[index], workload.arrival_s[index]
    if timing is None:
        decode_start = arrival + prompt / profile.prefill_tokens_per_s
        rate = np.full(len(index), profile.decode_tokens_per_s)
    else:
        decode_start = np.maximum(timing.decode_start_s[index], arrival)
        rate = timing.decode_tokens_per_s[index]
    first_blocks = -(-prompt // block)
    # Block m (1-based) is first needed by generated token k = (m - 1) * block + 1 - prompt; the
    # token at k == output ends the request, so blocks needed only by it are never allocated.
    num_updates = np.maximum(-(-(prompt + output - 1) // block) - first_blocks, 0)
    owner = np.repeat(np.arange(len(index)), num_updates)
    offset = np.arange(len(owner)) - np.repeat(np.cumsum(num_updates) - num_updates, num_updates)
    blocks = first_blocks[owner] + 1 + offset
    generated = (blocks - 1) * block + 1 - prompt[owner]
    times = np.concatenate([arrival, decode_start[owner] + generated / rate[owner], decode_start + output / rate])
    kinds = np.concatenate([np.full(len(index), ALLOCATE), np.full(len(owner), UPDATE),
                            np.full(len(index), DEPART)])
    requests = np.concatenate([index, index[owner], index])
    tokens = np.concatenate([first_blocks * block, blocks * block, np.zeros(len(index), np.int64)])
    order = np.lexsort((kinds, times))
    return Events(times[order].tolist(), kinds[order].tolist(), requests[order].tolist(),
                  tokens[order].tolist(), len(index), len(workload) - len(index))
