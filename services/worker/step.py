"""The step contract between the scheduler (driver / router) and workers; converted to protobuf only at the edge."""

from __future__ import annotations

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

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


GREEDY = SamplingParams()


@dataclass(frozen=True, slots=True)
class SequenceStep:
    """One request's share of a step."""

    request_id: str
    token_ids: tuple[int, ...]         # new tokens: a prompt chunk, or the last sampled token
    start_position: int                # tokens already in the KV cache (position of token_ids[0])
    block_table: tuple[int, ...]       # global KV block ids covering the cached + new tokens, in order
    sampling: SamplingParams = GREEDY
    sample: bool = True                # False for a non-final prefill chunk: no token is produced
    return_logits: bool = False        # tests/debugging: ship the last position's logits back
    num_generated: int = 0             # tokens generated so far; keys the seeded sampler per position

    def to_pb(self) -> worker_pb2.SequenceStep:
        s = self.sampling
        return worker_pb2.SequenceStep(
            request_id=self.request_id,
            token_ids=self.token_ids,
            start_position=self.start_position,
            block_table=self.block_table,
            sampling=worker_pb2.SamplingParams(
                temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed
            ),
            sample=self.sample,
            return_logits=self.return_logits,
            num_generated=self.num_generated,
        )

    @classmethod
    def from_pb(cls, pb: worker_pb2.SequenceStep) -> SequenceStep:
        s = pb.sampling
        return cls(
            request_id=pb.request_id,
            token_ids=tuple(pb.token_ids),
            start_position=pb.start_position,
            block_table=tuple(pb.block_table),
            sampling=SamplingParams(
                temperature=s.temperature,
                top_p=s.top_p or 1.0,
                top_k=s.top_k,
                seed=s.seed if s.HasField("seed") else None,
            ),
            sample=pb.sample,
            return_logits=pb.return_logits,
            num_generated=pb.num_generated,
        )


@dataclass(frozen=True, slots=True)
class StepBatch:
    """Everything a worker needs to run one step; every active worker gets the same batch in the same order."""

    step_id: int
    sequences: tuple[SequenceStep, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.sequences)

    def to_pb(self) -> worker_pb2.StepRequest:
        return worker_pb2.StepRequest(step_id=self.step_id, sequences=[s.to_pb() for s in self.sequences])

    @classmethod
    def from_pb(cls, pb: worker_pb2.StepRequest) -> StepBatch:
        return cls(pb.step_id, tuple(SequenceStep.from_pb(s) for s in pb.sequences))


@dataclass(frozen=True, slots=True)
class SequenceOutput:
    """What one step produced for one request (last stage only)."""

    request_id: str
    token_id: int                      # -1 when the step did not sample
    logits: bytes = b""                # float32 little-endian, when requested


@dataclass(frozen=True, slots=True)
class StepOutput:
    """A worker's answer to one step."""

    step_id: int
    rank: int
    outputs: tuple[SequenceOutput, ...] = field(default_factory=tuple)
    error: str = ""
    compute_seconds: float = 0.0

    def to_pb(self) -> worker_pb2.StepResult:
        return worker_pb2.StepResult(
            step_id=self.step_id,
            rank=self.rank,
            results=[
                worker_pb2.SequenceResult(request_id=o.request_id, token_id=o.token_id, logits=o.logits)
                for o in self.outputs
            ],
            error=self.error,
            compute_seconds=self.compute_seconds,
        )

    @classmethod
    def from_pb(cls, pb: worker_pb2.StepResult) -> StepOutput:
        return cls(
            step_id=pb.step_id,
            rank=pb.rank,
            outputs=tuple(SequenceOutput(r.request_id, r.token_id, r.logits) for r in pb.results),
            error=pb.error,
            compute_seconds=pb.compute_seconds,
        )
