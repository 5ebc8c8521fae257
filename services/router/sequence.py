"""A request as the scheduler sees it: its tokens, how many of them are cached on the workers, and its blocks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from services.contracts.step import GREEDY, SamplingParams, TokenLogprob
from services.router.contracts import GenerationRequest


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life: queued, holding KV blocks, or done (and why)."""

    WAITING = "waiting"                  # queued; holds no KV blocks (new, or preempted by recompute)
    RUNNING = "running"                  # holds KV blocks; prefilling in chunks or decoding
    FINISHED_STOPPED = "stopped"         # a stop token (or an engine-detected stop string)
    FINISHED_LENGTH = "length"           # max_tokens generated
    FINISHED_ABORTED = "aborted"         # the client went away or the request was cancelled

    @property
    def is_finished(self) -> bool:
        return self._value_ in _FINISH_REASONS  # by value: an Enum member hashes in Python, its str value in C

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason ("stop" | "length" | "abort"), None while unfinished."""
        return _FINISH_REASONS.get(self._value_)


_FINISH_REASONS = {"stopped": "stop", "length": "length", "aborted": "abort"}  # by SequenceStatus value


@dataclass(slots=True)
class Sequence:
    """One request's mutable scheduling state; the scheduler owns it, workers only see SequenceSteps."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = GREEDY
    stop_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0         # tokens whose KV is cached on the workers (after the last finished step)
    block_ids: list[int] = field(default_factory=list)  # global KV block ids, in token order
    status: SequenceStatus = SequenceStatus.WAITING
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0             # times its KV was dropped to be recomputed later
    num_prefills: int = 0                # times its prefix was (re)prefilled: 1 + preemptions once it ran
    min_tokens: int = 0                  # stop tokens are suppressed until this many tokens were generated
    wants_prompt_logprobs: bool = False  # echo with logprobs
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1, 2, ... so far
    # Derived once from `sampling` (it never changes): what the scheduler asks of every decode step.
    decodes_plainly: bool = field(init=False, repr=False, compare=False)  # a decode needs only its input token
    _table: tuple[int, ...] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.decodes_plainly = not self.sampling.has_output_penalties and self.sampling.num_logprobs is None

    @classmethod
    def from_request(cls, request: GenerationRequest, arrival_time: float | None = None) -> Sequence:
        """A fresh WAITING sequence for `request` (stop strings stay with the engine: they need the text)."""
        return cls(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            max_tokens=request.max_tokens,
            sampling=request.sampling,
            stop_token_ids=frozenset(request.stop_token_ids),
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            min_tokens=request.min_tokens,
            wants_prompt_logprobs=request.prompt_logprobs,
        )

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_at(self, start: int, count: int) -> list[int]:
        """Tokens start .. start + count - 1 of prompt + outputs, without joining the two (O(count), not O(context):
        a decode reads one token)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:start - num_prompt + count]
        return (self.prompt_token_ids + self.output_token_ids)[start:start + count]

    def block_table(self) -> tuple[int, ...]:
        """block_ids as a tuple (what a step carries), rebuilt only when they changed: most decode steps add no
        block, so this is not O(context) per step. Whoever rewrites block_ids other than by appending or truncating
        (a repartition) calls blocks_rewritten()."""
        if self._table is None or len(self._table) != len(self.block_ids):
            self._table = tuple(self.block_ids)
        return self._table

    def blocks_rewritten(self) -> None:
        self._table = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to feed before the next token can be sampled (1 for a decode: the last sampled token)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while the cache lacks more than the last sampled token, or holds nothing of this sequence.

        A decode feeds exactly one token on top of a non-empty cache; everything else (a new prompt, a later chunk
        of it, a preempted sequence re-feeding prompt + outputs) is a prefill. The one-token last chunk of a
        chunked prompt counts as a decode: it is fed and sampled exactly like one.
        """
        return self.num_computed_tokens == 0 or self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def has_prompt_logprobs(self) -> bool:
        """Whether every prompt logprob asked for is known (prompt tokens 1..n-1)."""
        return len(self.prompt_logprobs) >= self.num_prompt_tokens - 1
