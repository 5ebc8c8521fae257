"""The router's protobuf edge: requests, deltas, stats and reports to and from the wire, with the checks of what
arrives (ValueError: the servicer answers INVALID_ARGUMENT). Pure functions; the servicer (grpc_server) and the
controller's view of the router (stats_from_pb) share them."""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence

from services.contracts.step import SamplingParams, WorkerTime
from services.model.tokenizer import Tokenizer
from services.router.contracts import EngineStats, GenerationDelta, GenerationRequest, SwitchReport
from services.router.load_window import LoadSnapshot
from services.rpc.errors import check_address
from services.rpc.reconfig.v1 import router_pb2, worker_pb2

MAX_KV_BLOCKS = 1 << 22       # the block manager lists its free ids: a larger capacity is a bad request, not a GiB


def sampling_from_pb(pb: router_pb2.GenerateRequest) -> SamplingParams:
    """Sampling parameters of a request; ValueError on values out of range."""
    if not pb.HasField("sampling"):
        return SamplingParams()
    s = pb.sampling
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {s.temperature}")
    if not 0 <= s.top_p <= 1:
        raise ValueError(f"top_p must be in [0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {s.top_k}")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2 <= getattr(s, name) <= 2:
            raise ValueError(f"{name} must be in [-2, 2], got {getattr(s, name)}")
    if not (math.isfinite(s.repetition_penalty) and s.repetition_penalty >= 0):
        raise ValueError(f"repetition_penalty must be a finite number > 0 (0: none), got {s.repetition_penalty}")
    bad_bias = next(((t, b) for t, b in s.logit_bias.items() if t < 0 or not -100 <= b <= 100), None)
    if bad_bias is not None:
        raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {bad_bias}")
    if s.HasField("num_logprobs") and not 0 <= s.num_logprobs <= 20:
        raise ValueError(f"num_logprobs must be in [0, 20], got {s.num_logprobs}")
    return SamplingParams.from_pb(s)


def request_from_pb(pb: router_pb2.GenerateRequest, tokenizer: Tokenizer,
                    encoded_prompt: Sequence[int] | None = None) -> GenerationRequest:
    """A GenerationRequest from the wire; ValueError on malformed input (the engine checks lengths).
    `encoded_prompt`: pb.prompt already tokenized (else it is tokenized here)."""
    if bool(pb.prompt_token_ids) == bool(pb.prompt):
        raise ValueError("set exactly one of prompt_token_ids and prompt")
    if pb.prompt_token_ids:
        prompt_token_ids = tuple(pb.prompt_token_ids)
    else:
        prompt_token_ids = tuple(encoded_prompt if encoded_prompt is not None else tokenizer.encode(pb.prompt))
    bad = [t for t in prompt_token_ids if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})")
    if pb.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {pb.max_tokens}")
    if not 0 <= pb.min_tokens <= pb.max_tokens:
        raise ValueError(f"min_tokens must be in [0, max_tokens], got {pb.min_tokens}")
    stop_token_ids = frozenset(pb.stop_token_ids) | (frozenset() if pb.ignore_eos else tokenizer.eos_token_ids)
    return GenerationRequest(
        request_id=pb.request_id or f"grpc-{uuid.uuid4().hex}",
        prompt_token_ids=prompt_token_ids,
        max_tokens=pb.max_tokens,
        sampling=sampling_from_pb(pb),
        stop_token_ids=stop_token_ids,
        stop_strings=tuple(s for s in pb.stop if s),
        min_tokens=pb.min_tokens,
    )


def check_freeze(pb: router_pb2.FreezeRequest) -> None:
    """ValueError unless the lease is a finite number of seconds >= 0."""
    if not (math.isfinite(pb.lease_seconds) and pb.lease_seconds >= 0):
        raise ValueError(f"lease_seconds must be a finite number >= 0, got {pb.lease_seconds}")


def check_rebind(pb: router_pb2.RebindRequest) -> None:
    """ValueError unless the capacity is not absurd and every worker address reads host:port (the scheduler
    refuses a capacity below 1)."""
    if pb.num_kv_blocks > MAX_KV_BLOCKS:
        raise ValueError(f"num_kv_blocks must be at most {MAX_KV_BLOCKS}, got {pb.num_kv_blocks}")
    for address in pb.worker_addresses:
        check_address(address)
    if pb.worker_infos and len(pb.worker_infos) != len(pb.worker_addresses):
        raise ValueError(f"{len(pb.worker_infos)} worker infos for {len(pb.worker_addresses)} worker addresses")


def block_maps_to_pb(maps) -> list[worker_pb2.BlockMap]:
    """{(old pool, new pool): (old ids, new ids)} -> BlockMap messages, by pool pair."""
    return [worker_pb2.BlockMap(src_pool=src, dst_pool=dst, src_block_ids=old, dst_block_ids=new)
            for (src, dst), (old, new) in sorted(maps.items())]


def delta_to_pb(request_id: str, delta: GenerationDelta) -> router_pb2.GenerateResponse:
    """One streamed response."""
    return router_pb2.GenerateResponse(
        request_id=request_id, token_ids=delta.token_ids, text=delta.text,
        finish_reason=delta.finish_reason or "",
        usage=router_pb2.Usage(prompt_tokens=delta.num_prompt_tokens, completion_tokens=delta.num_generated_tokens),
        error=delta.error or "",
        logprobs=[logprob.to_pb() for logprob in delta.logprobs],
    )


def stats_to_pb(stats: EngineStats) -> router_pb2.RouterStats:
    """EngineStats → RouterStats."""
    return router_pb2.RouterStats(
        num_running=stats.num_running, num_waiting=stats.num_waiting,
        num_kv_blocks_total=stats.num_kv_blocks_total, num_kv_blocks_used=stats.num_kv_blocks_used,
        num_preemptions=stats.num_preemptions, num_decodes_ahead=stats.num_decodes_ahead,
        num_prompt_tokens=stats.num_prompt_tokens,
        num_generation_tokens=stats.num_generation_tokens, topology=stats.topology,
        is_frozen=stats.is_frozen, extra=stats.extra, stalled=stats.stalled,
        num_kv_blocks_used_per_dp_rank=stats.num_kv_blocks_used_per_dp_rank,
        window=window_to_pb(stats.window),
        worker_time=[router_pb2.WorkerTime(rank=w.rank, forward_seconds=w.forward_seconds,
                                           head_seconds=w.head_seconds, steps=w.steps) for w in stats.worker_time],
        block_size=stats.block_size, max_model_len=stats.max_model_len,
    )


def stats_from_pb(pb: router_pb2.RouterStats) -> EngineStats:
    """RouterStats → EngineStats (the controller's view of the router)."""
    return EngineStats(
        num_running=pb.num_running, num_waiting=pb.num_waiting,
        num_kv_blocks_total=pb.num_kv_blocks_total, num_kv_blocks_used=pb.num_kv_blocks_used,
        num_preemptions=pb.num_preemptions, num_decodes_ahead=pb.num_decodes_ahead,
        num_prompt_tokens=pb.num_prompt_tokens,
        num_generation_tokens=pb.num_generation_tokens, topology=pb.topology,
        is_frozen=pb.is_frozen, extra=dict(pb.extra), stalled=pb.stalled,
        num_kv_blocks_used_per_dp_rank=tuple(pb.num_kv_blocks_used_per_dp_rank),
        window=window_from_pb(pb.window),
        worker_time=tuple(WorkerTime(w.rank, w.forward_seconds, w.head_seconds, w.steps) for w in pb.worker_time),
        block_size=pb.block_size, max_model_len=pb.max_model_len,
    )


def window_to_pb(window: LoadSnapshot) -> router_pb2.LoadWindow:
    return router_pb2.LoadWindow(
        window_seconds=window.window_s, arrival_rate=window.arrival_rate,
        mean_prompt_tokens=window.mean_prompt_tokens, mean_output_tokens=window.mean_output_tokens,
        ttft_p50_seconds=window.ttft_p50_s, ttft_p99_seconds=window.ttft_p99_s,
        tpot_mean_seconds=window.tpot_mean_s, tpot_p99_seconds=window.tpot_p99_s, num_finished=window.num_finished,
        mean_context_tokens=window.mean_context_tokens, num_requests=window.num_requests,
        prompt_tokens_std=window.prompt_tokens_std, output_tokens_std=window.output_tokens_std,
        arrival_dispersion=window.arrival_dispersion,
    )


def window_from_pb(pb: router_pb2.LoadWindow) -> LoadSnapshot:
    return LoadSnapshot(
        window_s=pb.window_seconds, arrival_rate=pb.arrival_rate, mean_prompt_tokens=pb.mean_prompt_tokens,
        mean_output_tokens=pb.mean_output_tokens, ttft_p50_s=pb.ttft_p50_seconds, ttft_p99_s=pb.ttft_p99_seconds,
        tpot_mean_s=pb.tpot_mean_seconds, tpot_p99_s=pb.tpot_p99_seconds, num_finished=pb.num_finished,
        mean_context_tokens=pb.mean_context_tokens, num_requests=pb.num_requests,
        prompt_tokens_std=pb.prompt_tokens_std, output_tokens_std=pb.output_tokens_std,
        arrival_dispersion=pb.arrival_dispersion or 1.0,  # 0: a router that does not report it (or arrivals
        # perfectly even): read as random, which the policy treats the same
    )


def switch_report_from_pb(pb: router_pb2.SwitchReport) -> SwitchReport:
    """SwitchReport (wire) → SwitchReport (contract)."""
    return SwitchReport(
        operation_id=pb.operation_id, from_topology=pb.from_topology, to_topology=pb.to_topology, state=pb.state,
        phase_seconds=dict(pb.phase_seconds), kv_bytes_moved=pb.kv_bytes_moved,
        kv_bytes_precopied=pb.kv_bytes_precopied,
        weight_bytes_loaded=pb.weight_bytes_loaded, num_requests_preempted=pb.num_requests_preempted,
    )
