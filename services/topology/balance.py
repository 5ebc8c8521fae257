"""Layers per pipeline stage in proportion to measured speed: the split that minimises the slowest stage.

A stage's step takes  fixed + layers · per_layer  seconds (fixed: the last stage's final norm, lm_head and sampling,
which no split can move; per_layer: its slowest worker's time per layer). The pipeline's step is bounded by its
slowest stage, so the best split minimises max over stages. Each stage's cost grows with every layer it is given,
so handing out the layers one at a time, each to the stage whose cost would then be lowest, reaches the optimum
(the greedy is exact for min-max allocations of identical units under increasing costs).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

BALANCE_MIN_GAIN = 0.05  # a split is worth a switch's partition only if the slowest stage gets this much faster


def balanced_partition(per_layer_s: Sequence[float], num_layers: int,
                       fixed_s: Sequence[float] | None = None) -> tuple[int, ...]:
    """Layers per stage (each >= 1, summing to num_layers) minimising max(fixed + layers · per_layer)."""
    stages = len(per_layer_s)
    if stages < 1 or num_layers < stages:
        raise ValueError(f"{num_layers} layers cannot fill {stages} stages")
    fixed = list(fixed_s) if fixed_s is not None else [0.0] * stages
    if len(fixed) != stages or min(per_layer_s) < 0 or min(fixed) < 0:
        raise ValueError("per_layer_s and fixed_s need one non-negative value per stage")
    layers = [1] * stages
    # (cost with one more layer, stage): ties go to the earlier stage, so equal speeds give the even split.
    heap = [(fixed[i] + 2 * per_layer_s[i], i) for i in range(stages)]
    heapq.heapify(heap)
    for _ in range(num_layers - stages):
        _, i = heapq.heappop(heap)
        layers[i] += 1
        heapq.heappush(heap, (fixed[i] + (layers[i] + 1) * per_layer_s[i], i))
    return tuple(layers)


def slowest_stage_s(partition: Sequence[int], per_layer_s: Sequence[float],
                    fixed_s: Sequence[float] | None = None) -> float:
    """The step time bound of a split: its slowest stage."""
    fixed = list(fixed_s) if fixed_s is not None else [0.0] * len(partition)
    return max(f + n * s for n, s, f in zip(partition, per_layer_s, fixed))
