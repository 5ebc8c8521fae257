"""What the scheduler hands the engine for one step, and what a finished step did: the router's side of a step.

A ScheduledBatch holds one ScheduledItem per sequence, each with the SequenceStep the workers get for it
(services.contracts.step; the driver sends it in the delta form, services.contracts.step_rows). on_batch_done turns the
workers' result back into one SequenceUpdate per sequence, which the engine pushes to the request's stream.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from services.contracts.step import SequenceStep, TokenLogprob
from services.router.sequence import Sequence


@dataclass(slots=True)  # not frozen, as the step path's records (services.contracts.step)
class ScheduledItem:
    """One sequence's share of a micro-batch: the sequence and the step sent to the workers for it."""

    seq: Sequence
    step: SequenceStep


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """A micro-batch: what one step feeds; batch_id doubles as the workers' step_id."""

    batch_id: int
    items: tuple[ScheduledItem, ...]
    num_full_prefills: int = 0  # items feeding a request from position 0 (counted as it is built, not per step)

    @property
    def steps(self) -> tuple[SequenceStep, ...]:
        return tuple(item.step for item in self.items)

    @property
    def num_tokens(self) -> int:
        return sum(len(item.step.token_ids) for item in self.items)


@dataclass(slots=True)  # not frozen, as the step path's records (services.contracts.step)
class SequenceUpdate:
    """What a finished step did to one sequence: its new tokens, and whether it is done (seq.status says why)."""

    seq: Sequence
    new_token_ids: tuple[int, ...]
    finished: bool
    logprobs: tuple[TokenLogprob, ...] = ()  # of new_token_ids, when the request asked for them


def step_for(seq: Sequence, num_new_tokens: int, dp_rank: int) -> SequenceStep:
    """The step feeding `seq`'s next `num_new_tokens` tokens from its cached ones (a prefill chunk or a decode)."""
    start = seq.num_computed_tokens
    sample = start + num_new_tokens == seq.num_tokens and seq.max_tokens > 0
    return SequenceStep(
        request_id=seq.request_id,
        token_ids=tuple(seq.token_ids_at(start, num_new_tokens)),
        start_position=start,
        block_table=seq.block_table(),
        sampling=seq.sampling,
        sample=sample,
        num_generated=len(seq.output_token_ids),
        dp_rank=dp_rank,
        **_sampling_context(seq, start, num_new_tokens, sample),
    )


def _sampling_context(seq: Sequence, start: int, num_new_tokens: int, sample: bool) -> dict:
    """What the last stage needs of the request's history for this step, only where its options use it: the
    router owns that history, so it stays right across preemptions and layout switches."""
    context: dict = {}
    if sample and seq.sampling.has_output_penalties:
        context["output_token_counts"] = tuple(sorted(Counter(seq.output_token_ids).items()))
        if seq.sampling.repetition_penalty != 1:
            context["distinct_prompt_token_ids"] = tuple(sorted(set(seq.prompt_token_ids)))
    if sample and len(seq.output_token_ids) < seq.min_tokens:
        context["suppressed_token_ids"] = tuple(sorted(seq.stop_token_ids))
    last_target = min(start + num_new_tokens, seq.num_prompt_tokens - 1)  # the last prompt position to score
    if seq.wants_prompt_logprobs and not seq.has_prompt_logprobs and last_target > start:
        context["prompt_logprob_token_ids"] = tuple(seq.prompt_token_ids[start + 1:last_target + 1])
    return context
