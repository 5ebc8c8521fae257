"""Runs this worker's part of a step: embed or receive hidden states, run local layers, hand off or sample."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from services.contracts.step import PENDING_TOKEN, SequenceOutput, StepBatch, StepOutput, TokenLogprob
from services.model.attention import AttentionMetadata
from services.model.llama import ShardedCausalLM
from services.topology import Placement, WorkerPlacement
from services.worker.decode_graphs import DecodeGraphs
from services.model.device_io import to_device
from services.worker.faults import FAULTS
from services.worker.kv_cache import KVCache
from services.worker.logits_processor import process_logits
from services.worker.logprobs import as_logprobs, logprob_tensors
from services.worker.parallel import ParallelState
from services.worker.sampler import sample_outputs, sample_tensor


class PendingTokenMissing(ValueError):
    """A step fed PENDING_TOKEN for a position this worker's previous step did not sample (the step before it
    failed, or the router sent it ahead where it must not): the step fails before any collective."""


@dataclass(frozen=True, slots=True)
class _Sampled:
    """What a step sampled, kept for the step sent after it: the tokens stay on the device, and only which row of
    them belongs to which request at which position is known on the host."""

    tokens: torch.Tensor                                     # [R] int64, on the device
    rows: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # request id -> (row, position)


_NOTHING_SAMPLED = _Sampled(torch.empty(0, dtype=torch.int64))


@dataclass(frozen=True, slots=True)
class _DeviceLogprobs:
    """The logprobs of rows drawn on the device: which of them (indices into _Sampling.request_ids), how many top
    tokens each asked for, and logprobs.logprob_tensors' values and ids (on the device, or copied to the host)."""

    rows: tuple[int, ...]
    num_top: tuple[int, ...]
    values: torch.Tensor  # [R, 1 + k] float32
    ids: torch.Tensor     # [R, k] int64

    def shifted(self, offset: int) -> _DeviceLogprobs:
        return dataclasses.replace(self, rows=tuple(r + offset for r in self.rows))

    def to_host(self) -> _DeviceLogprobs:
        """Non-blocking copies into pinned memory (read once the step's event completes)."""
        return dataclasses.replace(self, values=_pinned_copy(self.values), ids=_pinned_copy(self.ids))

    def outputs(self, tokens: list[int]) -> dict[int, TokenLogprob]:
        """Row -> its TokenLogprob, `tokens` being every row's drawn token (on the host)."""
        return dict(zip(self.rows, as_logprobs([tokens[r] for r in self.rows], self.values, self.ids, self.num_top),
                        strict=True))


@dataclass(frozen=True, slots=True)
class _DevicePromptLogprobs:
    """The prompt logprobs of a step's chunks, taken on the device: each asking request's id and its number of
    positions, every position's target token and top count, logprobs.logprob_tensors' values and ids."""

    request_ids: tuple[str, ...]
    counts: tuple[int, ...]
    targets: tuple[int, ...]
    num_top: tuple[int, ...]
    values: torch.Tensor  # [P, 1 + k] float32
    ids: torch.Tensor     # [P, k] int64

    def to_host(self) -> _DevicePromptLogprobs:
        return dataclasses.replace(self, values=_pinned_copy(self.values), ids=_pinned_copy(self.ids))

    def outputs(self) -> dict[str, tuple[TokenLogprob, ...]]:
        """Request id -> its positions' TokenLogprobs (on the host)."""
        logprobs = iter(as_logprobs(self.targets, self.values, self.ids, self.num_top))
        return {request_id: tuple(next(logprobs) for _ in range(count))
                for request_id, count in zip(self.request_ids, self.counts, strict=True)}


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


@dataclass(slots=True)
class _Sampling:
    """What (part of) a step drew on the last stage: outputs sampled on the host, and rows sampled on the device,
    whose tokens (and logprobs) stay there until the step's readback."""

    outputs: list[SequenceOutput] = dataclasses.field(default_factory=list)
    request_ids: tuple[str, ...] = ()      # the rows sampled on the device, ...
    tokens: torch.Tensor | None = None     # ... their tokens [len(request_ids)] int64, on the device
    logprobs: tuple[_DeviceLogprobs, ...] = ()  # ... the logprobs of those that asked
    prompt: tuple[_DevicePromptLogprobs, ...] = ()  # prompt logprobs taken on the device

    def joined(self, other: _Sampling) -> _Sampling:
        if self.tokens is None:
            request_ids, tokens = other.request_ids, other.tokens
        elif other.tokens is None:
            request_ids, tokens = self.request_ids, self.tokens
        else:
            request_ids, tokens = self.request_ids + other.request_ids, torch.cat([self.tokens, other.tokens])
        logprobs = self.logprobs + tuple(part.shifted(len(self.request_ids)) for part in other.logprobs)
        return _Sampling(self.outputs + other.outputs, request_ids, tokens, logprobs, self.prompt + other.prompt)


class LaunchedStep:
    """A step whose device work is queued. Its StepOutput is complete, or waits for the tokens it sampled on the
    device: they come to the host by a non-blocking copy into pinned memory, and `result()` (on a thread other than
    the model thread's, which goes on to launch the next step) waits for that copy alone."""

    __slots__ = ("output", "request_ids", "tokens", "event", "order", "logprobs", "prompt")

    def __init__(self, output: StepOutput, request_ids: tuple[str, ...] = (), tokens: torch.Tensor | None = None,
                 event: torch.cuda.Event | None = None, order: dict[str, int] | None = None,
                 logprobs: tuple[_DeviceLogprobs, ...] = (), prompt: tuple[_DevicePromptLogprobs, ...] = ()) -> None:
        self.output = output            # complete but for the rows of `tokens`
        self.request_ids = request_ids  # the request of each row of `tokens`
        self.tokens = tokens            # [len(request_ids)] int64 host tensor (filled once `event` completes)
        self.event = event
        self.order = order              # the batch's order of requests, where outputs come in another
        self.logprobs = logprobs        # the rows' logprobs, host tensors (filled with `tokens`)
        self.prompt = prompt            # prompt logprobs, host tensors (likewise)

    def result(self) -> StepOutput:
        if self.tokens is None:
            return self.output
        if self.event is not None:
            self.event.synchronize()
        tokens = self.tokens.tolist()
        if self.logprobs or self.prompt:
            logprobs = {row: lp for part in self.logprobs for row, lp in part.outputs(tokens).items()}
            prompt = {request_id: lps for part in self.prompt for request_id, lps in part.outputs().items()}
            drawn = tuple(SequenceOutput(request_id, token, logprob=logprobs.get(row),
                                         prompt_logprobs=prompt.pop(request_id, ()))
                          for row, (request_id, token) in enumerate(zip(self.request_ids, tokens, strict=True)))
            # a prefill chunk that does not sample still returns its prompt logprobs
            drawn += tuple(SequenceOutput(request_id, -1, prompt_logprobs=lps) for request_id, lps in prompt.items())
        else:
            drawn = tuple(map(SequenceOutput, self.request_ids, tokens))
        outputs = self.output.outputs + drawn
        if self.order is not None:
            outputs = tuple(sorted(outputs, key=lambda o: self.order[o.request_id]))
        return dataclasses.replace(self.output, outputs=outputs)


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
        # What the previous step sampled; a step sent ahead feeds these tokens, on the device.
        self._sampled = _NOTHING_SAMPLED

    graphs_refused = ""  # why decode graphs are off in this layout, when asked for

    def graph_support(self) -> str | None:
        """None when decode steps can be CUDA graphs here, else why not: a graph needs fixed shapes (no MoE
        routing: a TP layout's experts as grouped GEMMs, --kernels triton) and collectives a graph can hold (a
        single-rank stage, or NCCL: gloo runs on the host)."""
        if self.device.type != "cuda":
            return "not on a GPU"
        if not all(block.graphable for block in self.model.moe_blocks().values()):
            if self.placement.topology.ep > 1:
                return "an EP layout's experts exchange tokens in counts known only on the host"
            return "MoE layers route tokens with data-dependent shapes (--kernels triton groups them in fixed ones)"
        stage_size = self.placement.topology.stage_size
        if stage_size > 1 and (self.parallel is None or self.parallel.backend != "nccl"):
            return "the stage's collectives run over gloo (shared GPU)"
        return None

    def execute(self, batch: StepBatch, rank: int) -> StepOutput:
        """Run one step and wait for its output (launch(), then its result)."""
        return self.launch(batch, rank).result()

    @torch.inference_mode()
    def launch(self, batch: StepBatch, rank: int) -> LaunchedStep:
        """Queue one step's device work; no host synchronisation unless a row asks for its logits (every row is
        drawn on the device, greedy or not, processed or not, with its logprobs and prompt logprobs).
        Only the last stage's TP rank 0 returns outputs (in an EP layout, every last-stage rank, each for its own
        requests); in a single-stage layout every rank samples and keeps the tokens on the device for a step sent
        ahead (PENDING_TOKEN inputs)."""
        started = time.perf_counter()
        if not batch.sequences:
            return LaunchedStep(StepOutput(batch.step_id, rank))
        feed = self._pending_feed(batch.sequences)
        self._sampled = _NOTHING_SAMPLED  # a step that fails leaves nothing for the next one to feed
        seqs = batch.sequences
        if self.is_data_parallel:
            seqs = tuple(s for s in seqs if s.dp_rank == self.wp.dp_rank)
            if not seqs:  # the stage has work, this rank none: its MoE layers still join the stage's all-to-alls
                self.model.forward_empty()
                return LaunchedStep(StepOutput(batch.step_id, rank, compute_seconds=time.perf_counter() - started))
        output = StepOutput(batch.step_id, rank)
        sampling, output = self._run(seqs, feed, rank, output)
        if sampling is not None and self.keeps_samples:
            self._sampled = self._samples(seqs, sampling)
        output = dataclasses.replace(output, compute_seconds=time.perf_counter() - started)
        if sampling is None or self.wp.tp_rank != 0:  # (every rank of an EP layout is its stage's rank 0)
            return LaunchedStep(output)
        output = dataclasses.replace(output, outputs=tuple(sampling.outputs))
        if sampling.tokens is None:
            return LaunchedStep(output)
        # outputs sampled on the host and on the device (a mixed step's parts), and chunks that only return prompt
        # logprobs, go back in batch order
        order = {s.request_id: i for i, s in enumerate(seqs)} if sampling.outputs or sampling.prompt else None
        if sampling.tokens.device.type != "cuda":
            return LaunchedStep(output, sampling.request_ids, sampling.tokens, order=order, logprobs=sampling.logprobs,
                                prompt=sampling.prompt)
        host = _pinned_copy(sampling.tokens)
        logprobs = tuple(part.to_host() for part in sampling.logprobs)
        prompt = tuple(part.to_host() for part in sampling.prompt)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return LaunchedStep(output, sampling.request_ids, host, event, order, logprobs, prompt)

    def _run(self, seqs, feed, rank: int, output: StepOutput) -> tuple[_Sampling | None, StepOutput]:
        """The step's model work: through a decode graph, eagerly, or (a step of decodes and prefill chunks) its
        decodes through their graph and the rest eagerly, one after the other. What it sampled (None: nothing, or
        not the last stage), and `output` with its timings."""
        graphs = self.graphs
        if graphs is None:
            return self._run_eager(seqs, feed, rank, output)
        if graphs.accepts(seqs):
            return self._run_graph(seqs, feed), output
        decodes = [i for i, s in enumerate(seqs) if graphs.accepts((s,))]
        position = {i: j for j, i in enumerate(decodes)}  # row in the step -> row among its decodes
        if (not decodes or not graphs.accepts([seqs[i] for i in decodes])
                or (feed is not None and any(i not in position for i in feed[0]))):  # pending rows: decodes only
            return self._run_eager(seqs, feed, rank, output)
        rest = [i for i in range(len(seqs)) if i not in position]
        decode_feed = None if feed is None else ([position[i] for i in feed[0]], feed[1])
        sampled = self._run_graph(tuple(seqs[i] for i in decodes), decode_feed)
        rest_sampled, output = self._run_eager(tuple(seqs[i] for i in rest), None, rank, output)
        if sampled is None or rest_sampled is None:
            return sampled or rest_sampled, output
        return sampled.joined(rest_sampled), output

    def _samples(self, seqs, sampling: _Sampling) -> _Sampled:
        """What this step sampled (on the device, by row), with the position each token holds. With several TP
        ranks, only what every rank drew alike (greedy or seeded): a request sampled without a seed draws
        differently on each rank."""
        several = self.placement.topology.tp > 1
        positions = {s.request_id: s.start_position + len(s.token_ids) for s in seqs
                     if not several or s.sampling.draws_alike}
        request_ids, tokens = sampling.request_ids, sampling.tokens
        on_host = [(o.request_id, o.token_id) for o in sampling.outputs if o.token_id >= 0]
        if on_host:
            host_tokens = to_device([t for _, t in on_host], self.device)
            request_ids = request_ids + tuple(r for r, _ in on_host)
            tokens = host_tokens if tokens is None else torch.cat([tokens, host_tokens])
        if tokens is None:
            return _NOTHING_SAMPLED
        return _Sampled(tokens, {request_id: (row, positions[request_id]) for row, request_id in enumerate(request_ids)
                                 if request_id in positions})

    def _pending_feed(self, seqs) -> tuple[list[int], torch.Tensor] | None:
        """For a step fed PENDING_TOKEN: the rows of `seqs` that are, and the tokens the previous step sampled for
        them (on the device, in that order); None when no row is."""
        pending = [i for i, s in enumerate(seqs) if s.token_ids == (PENDING_TOKEN,)]
        if not pending:
            return None
        if not self.keeps_samples:  # every rank of the layout refuses alike, before any collective
            raise PendingTokenMissing(f"step feeds pending tokens, which only the ranks of a single-stage layout "
                                      f"keep, not those of {self.placement.topology}")
        sources = []
        for i in pending:
            s = seqs[i]
            row, position = self._sampled.rows.get(s.request_id, (-1, -1))
            if position != s.start_position:
                raise PendingTokenMissing(
                    f"a step feeds the token of {s.request_id!r} at position {s.start_position}, which this "
                    f"worker's previous step did not sample")
            sources.append(row)
        tokens = self._sampled.tokens
        if sources != list(range(len(tokens))):  # (in a steady decode, every row of the previous step, in order)
            tokens = tokens.index_select(0, to_device(sources, self.device))
        return pending, tokens

    def _sampling(self, seqs, wanted: list[int], logits: torch.Tensor, num_prompt_rows: int,
                  greedy: torch.Tensor | None = None) -> _Sampling | None:
        """What the rows `wanted` draw from `logits` (after `num_prompt_rows` rows of prompt logprobs): on the
        device unless one asks for its logits (greedy or not, processed or not, logprobs and prompt logprobs
        included: logits_processor, sampler.sample_tensor, logprobs.logprob_tensors; `greedy`: the raw logits'
        argmax, when already drawn), else on the host (the logits come over whole). None on a rank that neither
        returns nor keeps them."""
        if not (self.wp.tp_rank == 0 or self.keeps_samples):
            return None
        if self._samples_only(seqs, wanted):
            last = logits[num_prompt_rows:] if num_prompt_rows else logits
            chosen = [seqs[i] for i in wanted]
            processed = process_logits(last, chosen)
            tokens = sample_tensor(processed, [s.sampling for s in chosen], [s.num_generated for s in chosen],
                                   greedy if processed is last else None)
            logprobs, prompt = (), ()
            asking = [j for j, s in enumerate(chosen) if s.sampling.num_logprobs is not None]
            if asking and self.wp.tp_rank == 0:  # (the raw logits' logprobs, as the host's way takes them)
                num_top = tuple(chosen[j].sampling.num_logprobs or 0 for j in asking)
                logprobs = (_DeviceLogprobs(tuple(asking), num_top, *logprob_tensors(last, tokens, asking, num_top)),)
            if num_prompt_rows and self.wp.tp_rank == 0:
                prompt = (self._prompt_logprobs(seqs, logits[:num_prompt_rows]),)
            return _Sampling(request_ids=tuple(s.request_id for s in chosen),
                             tokens=tokens.clone(),  # (a graph's outputs are overwritten by its next replay)
                             logprobs=logprobs, prompt=prompt)
        return _Sampling(sample_outputs(list(seqs), wanted, logits.cpu(), num_prompt_rows))

    def _prompt_logprobs(self, seqs, logits: torch.Tensor) -> _DevicePromptLogprobs:
        """The prompt logprobs of the steps that asked, from their positions' logits [P, vocab] (steps in order,
        len(prompt_logprob_token_ids) rows each), on the device."""
        asking = [s for s in seqs if s.prompt_logprob_token_ids]
        targets = tuple(t for s in asking for t in s.prompt_logprob_token_ids)
        num_top = tuple(s.sampling.num_logprobs or 0 for s in asking for _ in s.prompt_logprob_token_ids)
        values, ids = logprob_tensors(logits, to_device(list(targets), self.device), None, num_top)
        return _DevicePromptLogprobs(tuple(s.request_id for s in asking),
                                     tuple(len(s.prompt_logprob_token_ids) for s in asking), targets, num_top,
                                     values, ids)

    @staticmethod
    def _samples_only(seqs, wanted: list[int]) -> bool:
        """Whether every row draws a token (any temperature, top-k, top-p, seed, penalties, bias, suppressed
        tokens; its logprobs or not) and asks for no logits."""
        return all(seqs[i].sample and not seqs[i].return_logits for i in wanted)

    def _run_eager(self, seqs, feed, rank: int, output: StepOutput) -> tuple[_Sampling | None, StepOutput]:
        meta = AttentionMetadata.build(
            [s.start_position for s in seqs],
            [len(s.token_ids) for s in seqs],
            [list(s.block_table) for s in seqs],
            self.kv_cache.block_size,
            self.device,
            prefill_kernel=self.model.kernels.prefill_attention is not None,
        )
        positions = torch.tensor([s.start_position + i for s in seqs for i in range(len(s.token_ids))],
                                 dtype=torch.int64, device=self.device)
        if self.prev_rank is None:
            inputs = to_device([t for s in seqs for t in s.token_ids], self.device)
            if feed is not None:  # a pending input is a step's one token: its row's first
                rows, tokens = feed
                inputs.index_copy_(0, to_device([meta.sequences[i].token_start for i in rows], self.device), tokens)
        else:
            shape = (sum(len(s.token_ids) for s in seqs), self.model.spec.hidden_size)
            inputs = self.parallel.recv(shape, self.model.dtype, self.device, self.prev_rank)
        forward_started = time.perf_counter()
        hidden = self.model.forward(inputs, positions, self.kv_cache.layers, meta)  # [T, hidden]
        output = dataclasses.replace(output, forward_seconds=self._measured("forward", forward_started, rank))
        if self.next_rank is not None:
            self.parallel.send(hidden, self.next_rank)
            return None, output
        head_started = time.perf_counter()
        wanted = [i for i, s in enumerate(seqs) if s.sample or s.return_logits]
        prompt_rows = self._prompt_logprob_rows(seqs, meta)
        if not wanted and not prompt_rows:
            return None, output
        last = [meta.sequences[i].token_start + meta.sequences[i].num_new_tokens - 1 for i in wanted]
        logits = self.model.compute_logits(hidden.index_select(0, to_device(prompt_rows + last, self.device)))
        sampling = self._sampling(seqs, wanted, logits, len(prompt_rows))  # the lm_head above: a TP collective
        return sampling, dataclasses.replace(output, head_seconds=self._measured("forward", head_started, rank))

    @staticmethod
    def _measured(point: str, started: float, rank: int) -> float:
        """Seconds since `started`, stretched by a `slow` fault rule (a slower device in tests). Host time: on CPU
        the work itself; on a GPU only its launch (the split by speed uses CPU measurements only)."""
        seconds = time.perf_counter() - started
        return seconds + FAULTS.slowdown(point, seconds, rank=rank)

    def _run_graph(self, seqs, feed) -> _Sampling | None:
        """A decode step through its CUDA graph: no host synchronisation when every row only samples (greedy
        tokens are drawn inside the graph, the others from its logits on the device; else the logits come to the
        host)."""
        hidden = None
        if self.prev_rank is not None:
            hidden = self.parallel.recv((len(seqs), self.model.spec.hidden_size), self.model.dtype, self.device,
                                        self.prev_rank)
        result = self.graphs.run(seqs, hidden, feed)
        if self.next_rank is not None:
            self.parallel.send(result.hidden, self.next_rank)
            return None
        wanted = [i for i, s in enumerate(seqs) if s.sample or s.return_logits]
        if not wanted:
            return None
        if len(wanted) == len(seqs):
            return self._sampling(seqs, wanted, result.logits, 0, result.greedy)
        rows = to_device(wanted, self.device)
        return self._sampling(seqs, wanted, result.logits.index_select(0, rows), 0, result.greedy.index_select(0, rows))

    @staticmethod
    def _prompt_logprob_rows(seqs, meta: AttentionMetadata) -> list[int]:
        """Rows of the hidden states whose logits give the prompt logprobs asked for: the first
        len(prompt_logprob_token_ids) positions fed for each sequence, in batch order."""
        rows: list[int] = []
        for s, slice_ in zip(seqs, meta.sequences, strict=True):
            if len(s.prompt_logprob_token_ids) > len(s.token_ids):
                raise ValueError(f"{s.request_id}: {len(s.prompt_logprob_token_ids)} prompt logprobs asked for "
                                 f"{len(s.token_ids)} positions fed")
            rows.extend(range(slice_.token_start, slice_.token_start + len(s.prompt_logprob_token_ids)))
        return rows
