"""Configuration of the router's scheduler."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of continuous batching: batch size, token budget, admission queue, context and pipelining."""

    max_model_len: int                   # prompt + max_tokens limit of one request (the model's context)
    max_num_seqs: int = 128              # sequences holding KV at once (running, in flight included)
    max_num_batched_tokens: int = 2048   # tokens fed per step (one micro-batch): decodes + prefill chunks
    max_waiting: int = 1024              # admission limit; past it add() raises QueueFullError
    # At least this many micro-batches in flight; the engine keeps the live layout's pp of them (one per stage, so
    # that every stage stays busy), and follows it when a switch changes pp.
    num_inflight_batches: int = 1
    enable_chunked_prefill: bool = True  # off: a prompt is fed whole, so it must fit one step's token budget
    # Spread the running decodes over the pp micro-batches in flight (at most ceil(running / pp) each) instead of
    # one micro-batch of all of them: each stage then works on its share at once. Off by default: on the 2-core CPU
    # machine, 4 stages sharing the cores lost (tp1pp4 0.66-1.04x, tp1pp2 1.08-1.31x: bench/pipeline.py); where each
    # stage has a device of its own it is what keeps a pipeline busy, not measured there yet.
    spread_decodes: bool = False
    # Async scheduling: in a single-stage layout (tpN, no pipeline, no EP), each decode's next step goes out before
    # its step returns (the scheduler's "ahead" steps), so the router's work for a step overlaps the workers'
    # compute of the one before. 1.1-1.5x decode tokens/s through one worker on CPU (bench/async_steps.py).
    async_scheduling: bool = True
    retry_after_s: float = 1.0           # what QueueFullError tells the client to wait

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_waiting",
                     "num_inflight_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.retry_after_s <= 0:
            raise ValueError(f"retry_after_s must be > 0, got {self.retry_after_s}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}): a whole prompt has to fit one step"
            )
