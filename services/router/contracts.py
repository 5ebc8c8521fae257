"""Contracts between the router's front ends (HTTP, gRPC) and its engine: plain dataclasses, no protobuf."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from services.contracts.phases import PREPARING_PHASES, SERVING_PHASES, STAGING_PHASE
from services.contracts.step import GREEDY, SamplingParams, TokenLogprob, WorkerTime
from services.model.tokenizer import Tokenizer
from services.router.load_window import LoadSnapshot


class QueueFullError(RuntimeError):
    """The router's waiting queue is full; retry after `retry_after_s`."""

    grpc_status = "RESOURCE_EXHAUSTED"  # services.rpc.errors reads it

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestError(ValueError):
    """A request the engine refuses (e.g. prompt longer than the context); maps to HTTP 400 / INVALID_ARGUMENT."""


class EngineDrainingError(RuntimeError):
    """The router is shutting down: it finishes the requests it admitted and takes no new one (HTTP 503 with
    `Connection: close`, gRPC UNAVAILABLE): the client retries elsewhere or later."""

    grpc_status = "UNAVAILABLE"  # services.rpc.errors reads it


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One generation request, already tokenized."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = GREEDY
    stop_token_ids: frozenset[int] = frozenset()   # finish when one is sampled (EOS unless ignore_eos)
    stop_strings: tuple[str, ...] = ()              # finish when the text contains one (trimmed from the output)
    min_tokens: int = 0                # stop tokens and stop strings cannot end the request before this many
    prompt_logprobs: bool = False      # echo: the prompt tokens' logprobs (sampling.num_logprobs alternatives)


@dataclass(slots=True)  # made per token per request: not frozen, as the step path's records (services.contracts.step)
class GenerationDelta:
    """What a request produced since its previous delta; the last one carries finish_reason."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error" | None while running
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0      # total so far
    error: str | None = None           # with finish_reason "error": what failed (a worker step, ...)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token_ids when sampling.num_logprobs is set
    # With request.prompt_logprobs, once (on the first delta after the prefill): prompt tokens 1..n-1 (the first
    # token has none).
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None




@dataclass(frozen=True, slots=True)
class SwitchReport:
    """What one layout switch did, as the controller reports it on the Resume that ends the switch."""

    operation_id: str
    from_topology: str
    to_topology: str
    state: str                         # "SUCCEEDED" (target live), "ROLLED_BACK" (old one whole) or "FAILED"
    phase_seconds: dict[str, float] = field(default_factory=dict)  # QUIESCING ... REBINDING, up to the Resume
    kv_bytes_moved: int = 0
    weight_bytes_loaded: int = 0
    num_requests_preempted: int = 0
    kv_bytes_precopied: int = 0        # before the freeze (PRECOPY); kv_bytes_moved is what moved in it

    @property
    def downtime_seconds(self) -> float:
        """First held request to resume (the cutover): every phase but the serving ones."""
        return sum(s for phase, s in self.phase_seconds.items() if phase not in SERVING_PHASES)

    @property
    def staging_seconds(self) -> float:
        """Before the freeze, while serving: STAGING and PRECOPY."""
        return sum(self.phase_seconds.get(phase, 0.0) for phase in PREPARING_PHASES)


@dataclass(frozen=True, slots=True)
class SwitchTotals:
    """Every switch the router was told about, summed since start (Prometheus counters and summaries)."""

    num_switches: dict[str, int] = field(default_factory=dict)     # by final state
    phase_seconds: dict[str, float] = field(default_factory=dict)  # summed over switches, by phase
    phase_counts: dict[str, int] = field(default_factory=dict)     # switches that went through each phase
    downtime_seconds: float = 0.0
    staging_seconds: float = 0.0
    num_staged: int = 0                # switches that staged their shards first
    kv_bytes_moved: int = 0
    weight_bytes_loaded: int = 0
    num_requests_preempted: int = 0
    last: SwitchReport | None = None
    kv_bytes_precopied: int = 0

    @property
    def num_total(self) -> int:
        """Switches reported, whatever their state."""
        return sum(self.num_switches.values())

    def add(self, report: SwitchReport) -> SwitchTotals:
        """These totals with one more switch."""
        num_switches, phase_seconds, phase_counts = (dict(self.num_switches), dict(self.phase_seconds),
                                                     dict(self.phase_counts))
        num_switches[report.state] = num_switches.get(report.state, 0) + 1
        for phase, seconds in report.phase_seconds.items():
            phase_seconds[phase] = phase_seconds.get(phase, 0.0) + seconds
            phase_counts[phase] = phase_counts.get(phase, 0) + 1
        return SwitchTotals(
            num_switches=num_switches, phase_seconds=phase_seconds, phase_counts=phase_counts,
            downtime_seconds=self.downtime_seconds + report.downtime_seconds,
            staging_seconds=self.staging_seconds + report.staging_seconds,
            num_staged=self.num_staged + (STAGING_PHASE in report.phase_seconds),
            kv_bytes_moved=self.kv_bytes_moved + report.kv_bytes_moved,
            kv_bytes_precopied=self.kv_bytes_precopied + report.kv_bytes_precopied,
            weight_bytes_loaded=self.weight_bytes_loaded + report.weight_bytes_loaded,
            num_requests_preempted=self.num_requests_preempted + report.num_requests_preempted,
            last=report,
        )


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine for /metrics, Stats and reconfigctl."""

    num_running: int = 0
    num_waiting: int = 0
    # Per worker: in EP layouts each data-parallel rank has its own pool of num_kv_blocks_total blocks (what Rebind
    # sets), and num_kv_blocks_used is the fullest rank's, so used <= total still reads as the KV cache usage.
    num_kv_blocks_total: int = 0
    num_kv_blocks_used: int = 0
    num_preemptions: int = 0
    num_decodes_ahead: int = 0         # decodes sent ahead of the step sampling their input (async scheduling)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    topology: str = ""
    is_frozen: bool = False
    extra: dict[str, float] = field(default_factory=dict)
    stalled: str = ""                  # why no step can run (a worker failed a step); "" when steps can run
    # EP layouts: blocks in use by data-parallel rank (router-local: RouterStats does not carry it); () otherwise.
    num_kv_blocks_used_per_dp_rank: tuple[int, ...] = ()
    window: LoadSnapshot = field(default_factory=LoadSnapshot)  # the last minute's arrivals and latencies
    worker_time: tuple[WorkerTime, ...] = ()  # each active worker's model work since the driver connected
    block_size: int = 0                # tokens per KV block
    max_model_len: int = 0             # the longest request (prompt + max_tokens) it takes


class EngineProtocol(Protocol):
    """What the HTTP and gRPC front ends need from the engine (services.router.engine.Engine implements it)."""

    model_name: str          # served model id (/v1/models)
    max_model_len: int       # prompt + max_tokens limit
    context_note: str        # why max_model_len is below the model's own limit ("": it is not), for its error
    tokenizer: Tokenizer

    @property
    def is_ready(self) -> bool:
        """Workers up and weights loaded (/ready)."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Stream a request's deltas. Raises QueueFullError / RequestError before the first delta.
        Closing the iterator early (client disconnect) aborts the request and frees its KV blocks."""
        ...

    def stats(self) -> EngineStats:
        ...

    def switch_totals(self) -> SwitchTotals:
        """Layout switches the controller reported since start (/metrics; router-local, not in RouterStats)."""
        ...
