"""Runs this worker's part of a step: embed or receive hidden states, run local layers, hand off or sample."""

from __future__ import annotations

import time

import torch

from services.model.attention import AttentionMetadata
from services.model.llama import ShardedCausalLM
from services.topology import Placement, WorkerPlacement
from services.worker.kv_cache import KVCache
from services.worker.parallel import ParallelState
from services.worker.sampler import sample_outputs
from services.worker.step import SequenceOutput, StepBatch, StepOutput


class ModelRunner:
    """Owns the model shard and KV cache of one worker; called from one thread, one step at a time."""

    def __init__(self, model: ShardedCausalLM, kv_cache: KVCache, placement: Placement, wp: WorkerPlacement,
                 parallel: ParallelState | None, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.placement = placement
        self.wp = wp
        self.parallel = parallel
        self.device = device
        size = placement.topology.stage_size
        # World ranks of this worker's PP neighbours (same TP / EP rank, previous / next stage).
        self.prev_rank = (wp.pp_rank - 1) * size + wp.stage_rank if not wp.is_first_stage else None
        self.next_rank = (wp.pp_rank + 1) * size + wp.stage_rank if not wp.is_last_stage else None
        self.is_data_parallel = wp.ep_size > 1  # EP layout: attention for this rank's own requests only

    @torch.inference_mode()
    def execute(self, batch: StepBatch, rank: int) -> StepOutput:
        """Run one step. Only the last stage's TP rank 0 returns outputs (in an EP layout, every last-stage rank,
        each for its own requests)."""
        started = time.perf_counter()
        if not batch.sequences:
            return StepOutput(batch.step_id, rank)
        seqs = batch.sequences
        if self.is_data_parallel:
            seqs = tuple(s for s in seqs if s.dp_rank == self.wp.dp_rank)
            if not seqs:  # the stage has work, this rank none: its MoE layers still join the stage's all-to-alls
                self.model.forward_empty()
                return StepOutput(batch.step_id, rank, compute_seconds=time.perf_counter() - started)
            batch = StepBatch(batch.step_id, seqs)
        meta = AttentionMetadata.build(
            [s.start_position for s in seqs],
            [len(s.token_ids) for s in seqs],
            [list(s.block_table) for s in seqs],
            self.kv_cache.block_size,
            self.device,
        )
        positions = torch.tensor([s.start_position + i for s in seqs for i in range(len(s.token_ids))],
                                 dtype=torch.int64, device=self.device)
        if self.prev_rank is None:
            inputs = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64, device=self.device)
        else:
            shape = (batch.num_tokens, self.model.spec.hidden_size)
            inputs = self.parallel.recv(shape, self.model.dtype, self.device, self.prev_rank)
        hidden = self.model.forward(inputs, positions, self.kv_cache.layers, meta)  # [T, hidden]
        if self.next_rank is not None:
            self.parallel.send(hidden, self.next_rank)
            return StepOutput(batch.step_id, rank, compute_seconds=time.perf_counter() - started)
        wanted = [i for i, s in enumerate(seqs) if s.sample or s.return_logits]
        prompt_rows = self._prompt_logprob_rows(batch, meta)
        outputs: list[SequenceOutput] = []
        if wanted or prompt_rows:
            last = [meta.sequences[i].token_start + meta.sequences[i].num_new_tokens - 1 for i in wanted]
            rows = torch.tensor(prompt_rows + last, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))  # [R, vocab]; a TP collective
            if self.wp.tp_rank == 0:
                outputs = sample_outputs(list(seqs), wanted, logits.cpu(), len(prompt_rows))
        return StepOutput(batch.step_id, rank, tuple(outputs), compute_seconds=time.perf_counter() - started)

    @staticmethod
    def _prompt_logprob_rows(batch: StepBatch, meta: AttentionMetadata) -> list[int]:
        """Rows of the hidden states whose logits give the prompt logprobs asked for: the first
        len(prompt_logprob_token_ids) positions fed for each sequence, in batch order."""
        rows: list[int] = []
        for s, slice_ in zip(batch.sequences, meta.sequences, strict=True):
            if len(s.prompt_logprob_token_ids) > len(s.token_ids):
                raise ValueError(f"{s.request_id}: {len(s.prompt_logprob_token_ids)} prompt logprobs asked for "
                                 f"{len(s.token_ids)} positions fed")
            rows.extend(range(slice_.token_start, slice_.token_start + len(s.prompt_logprob_token_ids)))
        return rows
