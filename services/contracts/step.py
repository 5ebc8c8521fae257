"""The step contract between the scheduler (driver / router) and workers; converted to protobuf only at the edge."""

from __future__ import annotations

import dataclasses
from array import array
from dataclasses import dataclass, field

from services.rpc.reconfig.v1 import worker_pb2


# Below this temperature sampling is greedy, as in vLLM: logits / 1e-40 overflow to inf and the softmax is NaN.
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick a request's next token."""

    temperature: float = 0.0   # 0 (or anything below MIN_TEMPERATURE) = greedy
    top_p: float = 1.0         # nucleus mass; 1 disables
    top_k: int = 0             # 0 disables
    seed: int | None = None    # set: the request's tokens do not depend on the batch it shares
    presence_penalty: float = 0.0      # OpenAI, on generated tokens; 0 disables
    frequency_penalty: float = 0.0     # OpenAI, per occurrence in the generated tokens; 0 disables
    repetition_penalty: float = 1.0    # Hugging Face, on prompt + generated tokens; 1 disables
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    num_logprobs: int | None = None    # set: return the sampled token's logprob and this many alternatives

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def draws_alike(self) -> bool:
        """Whether two samplers given the same logits draw the same token (greedy, or seeded by position): what
        lets every TP rank keep the token a step sent ahead feeds."""
        return self.is_greedy or self.seed is not None

    @property
    def has_output_penalties(self) -> bool:
        """Whether sampling needs the counts of the generated tokens."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def to_pb(self) -> worker_pb2.SamplingParams:
        return worker_pb2.SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=dict(self.logit_bias),
            num_logprobs=self.num_logprobs,
        )

    @classmethod
    def from_pb(cls, pb: worker_pb2.SamplingParams) -> SamplingParams:
        return cls(
            temperature=pb.temperature,
            top_p=pb.top_p or 1.0,
            top_k=pb.top_k,
            seed=pb.seed if pb.HasField("seed") else None,
            presence_penalty=pb.presence_penalty,
            frequency_penalty=pb.frequency_penalty,
            repetition_penalty=pb.repetition_penalty or 1.0,
            logit_bias=tuple(sorted(pb.logit_bias.items())),
            num_logprobs=pb.num_logprobs if pb.HasField("num_logprobs") else None,
        )


GREEDY = SamplingParams()
# A decode's input token when the router sent the step ahead of the one sampling it (async scheduling): the worker
# feeds the token it sampled for the request, at the step's start_position, in its previous step.
PENDING_TOKEN = -1


# The step path's records (SequenceStep, SequenceOutput; the scheduler's ScheduledItem and SequenceUpdate) are made
# per request per step and never changed after: they are not frozen only because a frozen dataclass's __init__ costs
# four times a plain one's (2.2 against 0.5 us for a SequenceStep), ~190 us a step at 64 requests.
@dataclass(slots=True)
class SequenceStep:
    """One request's share of a step (never changed once made)."""

    request_id: str
    token_ids: tuple[int, ...]         # new tokens: a prompt chunk, or the last sampled token
    start_position: int                # tokens already in the KV cache (position of token_ids[0])
    block_table: tuple[int, ...]       # global KV block ids covering the cached + new tokens, in order
    sampling: SamplingParams = GREEDY
    sample: bool = True                # False for a non-final prefill chunk: no token is produced
    return_logits: bool = False        # tests/debugging: ship the last position's logits back
    num_generated: int = 0             # tokens generated so far; keys the seeded sampler per position
    # The token history a penalty needs, sent only when the request has one (workers keep no request state):
    output_token_counts: tuple[tuple[int, int], ...] = ()  # (distinct generated id, occurrences)
    distinct_prompt_token_ids: tuple[int, ...] = ()        # repetition penalty only
    suppressed_token_ids: tuple[int, ...] = ()  # stop tokens masked before sampling: min_tokens not reached
    prompt_logprob_token_ids: tuple[int, ...] = ()  # echo: the prompt tokens after positions start_position...
    dp_rank: int = 0  # EP layouts: the data-parallel rank running this request's attention (its KV pool)

    def to_pb(self) -> worker_pb2.SequenceStep:
        # Only what is set: most steps are greedy decodes with none of the optional fields (the per-step cost of
        # this conversion and its reverse scales with the batch).
        fields = dict(request_id=self.request_id, token_ids=self.token_ids, start_position=self.start_position,
                      block_table=self.block_table, sample=self.sample, num_generated=self.num_generated,
                      dp_rank=self.dp_rank)
        if self.sampling is not GREEDY and self.sampling != GREEDY:  # absent: greedy
            fields["sampling"] = self.sampling.to_pb()
        if self.return_logits:
            fields["return_logits"] = True
        if self.output_token_counts:
            fields["output_token_ids"] = [token_id for token_id, _ in self.output_token_counts]
            fields["output_token_counts"] = [count for _, count in self.output_token_counts]
        if self.distinct_prompt_token_ids:
            fields["distinct_prompt_token_ids"] = self.distinct_prompt_token_ids
        if self.suppressed_token_ids:
            fields["suppressed_token_ids"] = self.suppressed_token_ids
        if self.prompt_logprob_token_ids:
            fields["prompt_logprob_token_ids"] = self.prompt_logprob_token_ids
        return worker_pb2.SequenceStep(**fields)

    @classmethod
    def from_pb(cls, pb: worker_pb2.SequenceStep) -> SequenceStep:
        output_token_ids, counts = pb.output_token_ids, pb.output_token_counts
        if len(output_token_ids) != len(counts):
            raise ValueError("output_token_ids and output_token_counts differ in length")
        distinct, suppressed, prompt_logprob = (pb.distinct_prompt_token_ids, pb.suppressed_token_ids,
                                                pb.prompt_logprob_token_ids)
        return cls(  # positional, in field order; the empty ones as ()
            pb.request_id, tuple(pb.token_ids), pb.start_position, tuple(pb.block_table),
            SamplingParams.from_pb(pb.sampling) if pb.HasField("sampling") else GREEDY,
            pb.sample, pb.return_logits, pb.num_generated,
            tuple(zip(output_token_ids, counts)) if counts else (),
            tuple(distinct) if distinct else (), tuple(suppressed) if suppressed else (),
            tuple(prompt_logprob) if prompt_logprob else (), pb.dp_rank,
        )


@dataclass(frozen=True, slots=True)
class StepBatch:
    """Everything a worker needs to run one step; every active worker gets the same batch in the same order."""

    step_id: int
    sequences: tuple[SequenceStep, ...]
    commit_expert_map: int = 0  # MoE: nonzero = install the expert map staged for this epoch before the step

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    def to_pb(self) -> worker_pb2.StepRequest:
        return worker_pb2.StepRequest(step_id=self.step_id, sequences=[s.to_pb() for s in self.sequences],
                                      commit_expert_map=self.commit_expert_map)

    @classmethod
    def from_pb(cls, pb: worker_pb2.StepRequest) -> StepBatch:
        return cls(pb.step_id, tuple(SequenceStep.from_pb(s) for s in pb.sequences), pb.commit_expert_map)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability at one position, and the most likely tokens there."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first

    def to_pb(self) -> worker_pb2.TokenLogprob:
        return worker_pb2.TokenLogprob(token_id=self.token_id, logprob=self.logprob,
                                       top_token_ids=[t for t, _ in self.top], top_logprobs=[p for _, p in self.top])

    @classmethod
    def from_pb(cls, pb: worker_pb2.TokenLogprob) -> TokenLogprob:
        return cls(pb.token_id, pb.logprob, tuple(zip(pb.top_token_ids, pb.top_logprobs, strict=True)))


@dataclass(slots=True)
class SequenceOutput:
    """What one step produced for one request (last stage only; never changed once made)."""

    request_id: str
    token_id: int                      # -1 when the step did not sample
    logits: bytes = b""                # float32 little-endian, when requested
    logprob: TokenLogprob | None = None              # the sampled token's, when sampling.num_logprobs is set
    prompt_logprobs: tuple[TokenLogprob, ...] = ()   # one per step.prompt_logprob_token_ids

    def to_pb(self) -> worker_pb2.SequenceResult:
        if not (self.logits or self.logprob or self.prompt_logprobs):  # most results: a token, nothing else
            return worker_pb2.SequenceResult(request_id=self.request_id, token_id=self.token_id)
        return worker_pb2.SequenceResult(
            request_id=self.request_id, token_id=self.token_id, logits=self.logits,
            sampled_logprob=self.logprob.to_pb() if self.logprob is not None else None,
            prompt_logprobs=[p.to_pb() for p in self.prompt_logprobs],
        )

    @classmethod
    def from_pb(cls, pb: worker_pb2.SequenceResult) -> SequenceOutput:
        prompt_logprobs = pb.prompt_logprobs
        return cls(
            pb.request_id, pb.token_id, pb.logits,
            TokenLogprob.from_pb(pb.sampled_logprob) if pb.HasField("sampled_logprob") else None,
            tuple(TokenLogprob.from_pb(p) for p in prompt_logprobs) if prompt_logprobs else (),
        )


@dataclass(frozen=True, slots=True)
class WorkerTime:
    """A worker's model work over the steps one driver sent it (cumulative; steps that ran its layers)."""

    rank: int
    forward_seconds: float = 0.0
    head_seconds: float = 0.0
    steps: int = 0


@dataclass(frozen=True, slots=True)
class StepOutput:
    """A worker's answer to one step."""

    step_id: int
    rank: int
    outputs: tuple[SequenceOutput, ...] = field(default_factory=tuple)
    error: str = ""
    compute_seconds: float = 0.0
    forward_seconds: float = 0.0       # this worker's layers (and embedding), without waiting for its inputs
    head_seconds: float = 0.0          # final norm, lm_head and sampling (last stage)
    tokens: tuple[int, ...] = ()       # a step sent in the delta form: the sampled token of each row, -1: none

    def expanded(self, request_ids) -> StepOutput:
        """This output with a SequenceOutput for every row that sampled (the delta form's packed tokens as outputs);
        `request_ids`: the step's rows in order."""
        if not self.tokens:
            return self
        extras = {o.request_id: o for o in self.outputs}
        outputs = tuple(extras.get(request_id) or SequenceOutput(request_id, token)
                        for request_id, token in zip(request_ids, self.tokens) if token >= 0 or request_id in extras)
        return dataclasses.replace(self, outputs=outputs, tokens=())

    def sampled(self, request_ids) -> dict[str, int]:
        """request id -> the token sampled for it; `request_ids`: the step's rows in order (the delta form's tokens
        come by position, the full form's in `outputs`)."""
        found = {o.request_id: o.token_id for o in self.outputs if o.token_id >= 0}
        if self.tokens:
            found.update((request_id, token) for request_id, token in zip(request_ids, self.tokens) if token >= 0)
        return found

    def to_pb(self) -> worker_pb2.StepResult:
        return worker_pb2.StepResult(
            step_id=self.step_id,
            rank=self.rank,
            results=[o.to_pb() for o in self.outputs],
            error=self.error,
            compute_seconds=self.compute_seconds,
            forward_seconds=self.forward_seconds,
            head_seconds=self.head_seconds,
        )

    @classmethod
    def from_pb(cls, pb: worker_pb2.StepResult) -> StepOutput:
        return cls(
            step_id=pb.step_id,
            rank=pb.rank,
            outputs=tuple(SequenceOutput.from_pb(r) for r in pb.results),
            error=pb.error,
            compute_seconds=pb.compute_seconds,
            forward_seconds=pb.forward_seconds,
            head_seconds=pb.head_seconds,
            tokens=tuple(array("i", pb.tokens)) if pb.tokens else (),
        )
