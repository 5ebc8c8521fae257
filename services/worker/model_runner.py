"""Runs this worker's part of a step: embed or receive hidden states, run local layers, hand off or sample."""

from __future__ import annotations

import dataclasses
import time

import torch

from services.contracts.step import PENDING_TOKEN, SequenceOutput, StepBatch, StepOutput
from services.model.attention import AttentionMetadata
from services.model.llama import ShardedCausalLM
from services.topology import Placement, WorkerPlacement
from services.worker.decode_graphs import DecodeGraphs
from services.worker.faults import FAULTS
from services.worker.kv_cache import KVCache
from services.worker.logits_processor import needs_processing
from services.worker.parallel import ParallelState
from services.worker.sampler import sample_outputs


class PendingTokenMissing(ValueError):
    """A step fed PENDING_TOKEN for a position this worker's previous step did not sample (the step before it
    failed, or the router sent it ahead where it must not): the step fails before any collective."""


class ModelRunner:
    """Owns the model shard and KV cache of one worker; called from one thread, one step at a time."""

    def __init__(self, model: ShardedCausalLM, kv_cache: KVCache, placement: Placement, wp: WorkerPlacement,
                 parallel: ParallelState | None, device: torch.device, cuda_graphs: bool = False) -> None:
        """cuda_graphs: replay decode steps as CUDA graphs where the layout allows (graph_support says why not)."""
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
        # The ranks of a single-stage layout (tp, not a pipeline, not EP) all sample each step, so that each keeps
        # the tokens a step sent ahead feeds; only TP rank 0 returns them.
        self.keeps_samples = wp.is_first_stage and wp.is_last_stage and not self.is_data_parallel
        self.graphs: DecodeGraphs | None = None
        if cuda_graphs and (why_not := self.graph_support()) is None:
            self.graphs = DecodeGraphs(model, kv_cache, device, capture=True)
        elif cuda_graphs:
            self.graphs_refused = why_not
        # What the previous step sampled, by request: (position, token); a step sent ahead feeds these.
        self._sampled: dict[str, tuple[int, int]] = {}

    graphs_refused = ""  # why decode graphs are off in this layout, when asked for

    def graph_support(self) -> str | None:
        """None when decode steps can be CUDA graphs here, else why not: a graph needs fixed shapes (no MoE
        routing) and collectives a graph can hold (a single-rank stage, or NCCL: gloo runs on the host)."""
        if self.device.type != "cuda":
            return "not on a GPU"
        if self.model.spec.shape.is_moe:
            return "MoE layers route tokens with data-dependent shapes"
        stage_size = self.placement.topology.stage_size
        if stage_size > 1 and (self.parallel is None or self.parallel.backend != "nccl"):
            return "the stage's collectives run over gloo (shared GPU)"
        return None

    @torch.inference_mode()
    def execute(self, batch: StepBatch, rank: int) -> StepOutput:
        """Run one step. Only the last stage's TP rank 0 returns outputs (in an EP layout, every last-stage rank,
        each for its own requests); in a single-stage layout every rank samples and remembers the tokens for a
        step sent ahead (PENDING_TOKEN inputs)."""
        if not batch.sequences:
            return StepOutput(batch.step_id, rank)
        batch = self._with_sampled_inputs(batch)
        self._sampled = {}  # a step that fails leaves nothing for the next one to feed
        output = self._execute(batch, rank)
        if self.keeps_samples:
            self._sampled = self._samples(batch, output.outputs)
            if self.wp.tp_rank != 0:
                output = dataclasses.replace(output, outputs=())
        return output

    def _samples(self, batch: StepBatch, outputs) -> dict[str, tuple[int, int]]:
        """(position, token) of what this step sampled, by request. With several TP ranks, only what every rank
        drew alike (greedy or seeded): a request sampled without a seed draws differently on each rank."""
        several = self.placement.topology.tp > 1
        positions = {s.request_id: s.start_position + len(s.token_ids) for s in batch.sequences
                     if not several or s.sampling.draws_alike}
        return {o.request_id: (positions[o.request_id], o.token_id) for o in outputs
                if o.token_id >= 0 and o.request_id in positions}

    def _with_sampled_inputs(self, batch: StepBatch) -> StepBatch:
        """The batch with each PENDING_TOKEN input replaced by the token the previous step sampled there."""
        if not any(s.token_ids == (PENDING_TOKEN,) for s in batch.sequences):
            return batch
        if not self.keeps_samples:  # every rank of the layout refuses alike, before any collective
            raise PendingTokenMissing(f"step {batch.step_id} feeds pending tokens, which only the ranks of a "
                                      f"single-stage layout keep, not those of {self.placement.topology}")
        seqs = []
        for s in batch.sequences:
            if s.token_ids == (PENDING_TOKEN,):
                position, token_id = self._sampled.get(s.request_id, (-1, -1))
                if position != s.start_position:
                    raise PendingTokenMissing(
                        f"step {batch.step_id} feeds the token of {s.request_id!r} at position {s.start_position}, "
                        f"which this worker's previous step did not sample")
                s = dataclasses.replace(s, token_ids=(token_id,))
            seqs.append(s)
        return StepBatch(batch.step_id, tuple(seqs), batch.commit_expert_map)

    def _execute(self, batch: StepBatch, rank: int) -> StepOutput:
        started = time.perf_counter()
        seqs = batch.sequences
        if self.is_data_parallel:
            seqs = tuple(s for s in seqs if s.dp_rank == self.wp.dp_rank)
            if not seqs:  # the stage has work, this rank none: its MoE layers still join the stage's all-to-alls
                self.model.forward_empty()
                return StepOutput(batch.step_id, rank, compute_seconds=time.perf_counter() - started)
            batch = StepBatch(batch.step_id, seqs)
        if self.graphs is not None and self.graphs.accepts(seqs):
            return self._execute_graph(batch, seqs, rank, started)
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
        forward_started = time.perf_counter()
        hidden = self.model.forward(inputs, positions, self.kv_cache.layers, meta)  # [T, hidden]
        forward_s = self._measured("forward", forward_started, rank)
        if self.next_rank is not None:
            self.parallel.send(hidden, self.next_rank)
            return StepOutput(batch.step_id, rank, compute_seconds=time.perf_counter() - started,
                              forward_seconds=forward_s)
        head_started = time.perf_counter()
        wanted = [i for i, s in enumerate(seqs) if s.sample or s.return_logits]
        prompt_rows = self._prompt_logprob_rows(batch, meta)
        outputs: list[SequenceOutput] = []
        if wanted or prompt_rows:
            last = [meta.sequences[i].token_start + meta.sequences[i].num_new_tokens - 1 for i in wanted]
            rows = torch.tensor(prompt_rows + last, device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))  # [R, vocab]; a TP collective
            if self.wp.tp_rank == 0 or self.keeps_samples:
                outputs = sample_outputs(list(seqs), wanted, logits.cpu(), len(prompt_rows))
        head_s = self._measured("forward", head_started, rank)
        return StepOutput(batch.step_id, rank, tuple(outputs), compute_seconds=time.perf_counter() - started,
                          forward_seconds=forward_s, head_seconds=head_s)

    @staticmethod
    def _measured(point: str, started: float, rank: int) -> float:
        """Seconds since `started`, stretched by a `slow` fault rule (a slower device in tests). Host time: on CPU
        the work itself; on a GPU only its launch (the split by speed uses CPU measurements only)."""
        seconds = time.perf_counter() - started
        return seconds + FAULTS.slowdown(point, seconds, rank=rank)

    def _execute_graph(self, batch: StepBatch, seqs, rank: int, started: float) -> StepOutput:
        """A decode step through its CUDA graph: one host synchronisation, for the tokens (or the logits when a
        request needs more than greedy argmax)."""
        hidden = None
        if self.prev_rank is not None:
            hidden = self.parallel.recv((len(seqs), self.model.spec.hidden_size), self.model.dtype, self.device,
                                        self.prev_rank)
        result = self.graphs.run(seqs, hidden)
        if self.next_rank is not None:
            self.parallel.send(result.hidden, self.next_rank)
            return StepOutput(batch.step_id, rank, compute_seconds=time.perf_counter() - started)
        outputs: list[SequenceOutput] = []
        if self.wp.tp_rank == 0 or self.keeps_samples:
            wanted = [i for i, s in enumerate(seqs) if s.sample or s.return_logits]
            chosen = [seqs[i] for i in wanted]
            if all(s.sample and s.sampling.is_greedy and s.sampling.num_logprobs is None and not s.return_logits
                   and not needs_processing(s) for s in chosen):
                tokens = result.greedy.tolist()
                outputs = [SequenceOutput(seqs[i].request_id, tokens[i]) for i in wanted]
            elif wanted:
                rows = torch.tensor(wanted, device=self.device)
                outputs = sample_outputs(list(seqs), wanted, result.logits.index_select(0, rows).cpu(), 0)
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
