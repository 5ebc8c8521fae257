"""The delta form of the step contract (StepRows in worker.proto): both sides of it.

The router's RowEncoder (owned by its Driver) remembers which rows each worker holds: a request's row reaches the
workers in full once (a SequenceStep: its tokens, sampling, block table), and every plain decode step after that
goes as four numbers in packed arrays (slot, position, input token, a new block id or -1). A decode step of 64
requests then weighs the same at 128 and 4096 tokens of context: the block table never travels again, only the one
block a row gains every block_size tokens. The worker's RowTable turns the arrays back into the SequenceSteps the
model runner takes.

The worker's rows are a cache of the router's requests, never their owner: the router starts a new epoch whenever
it cannot be sure what the workers hold (a switch, a rollback, a recovery, a failed step: Engine.resume and its
step failures), and a worker seeing a new epoch forgets every row; every row then goes in full again.
"""

from __future__ import annotations

import secrets
from array import array
from dataclasses import dataclass

from services.contracts.step import SamplingParams, SequenceOutput, SequenceStep, StepOutput
from services.rpc.reconfig.v1 import worker_pb2


class UnknownRow(ValueError):
    """A decode row names a slot this worker does not hold (the router believed otherwise): the step fails before
    any collective, and the router starts a new epoch."""


@dataclass(slots=True)
class _Sent:
    """What the workers hold of one request's row, as the router sent it."""

    slot: int
    sampling: SamplingParams
    dp_rank: int
    offset: int       # num_generated - start_position of the row's last step: the same for its decode steps
    num_blocks: int   # block ids the workers hold for it ...
    last_block: int   # ... and the last of them (-1: none)


class RowEncoder:
    """The router's side: encodes steps in the delta form and remembers what the workers hold."""

    def __init__(self) -> None:
        self.epoch = secrets.randbits(62) + 1  # distinct from any other encoder's (a replaced driver's)
        self._rows: dict[str, _Sent] = {}
        self._free_slots: list[int] = []
        self._num_slots = 0
        self._freed = array("i")

    def reset(self) -> None:
        """A new epoch: every row goes in full again (the workers may hold anything now)."""
        self.epoch += 1
        self._rows.clear()
        self._free_slots.clear()
        self._num_slots = 0
        self._freed = array("i")

    def forget(self, request_id: str) -> None:
        """The request ended: its slot is free, and the workers drop its row with the next step."""
        sent = self._rows.pop(request_id, None)
        if sent is not None:
            self._free_slots.append(sent.slot)
            self._freed.append(sent.slot)

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def encode(self, step_id: int, steps, commit_expert_map: int = 0) -> worker_pb2.StepRequest:
        slots, positions, tokens, new_blocks = array("i"), array("i"), array("i"), array("i")
        kinds = bytearray()
        full = []
        rows = self._rows
        add_slot, add_kind, add_position, add_token, add_block = (
            slots.append, kinds.append, positions.append, tokens.append, new_blocks.append)
        for step in steps:
            sent = rows.get(step.request_id)
            table = step.block_table
            # A plain decode (one token, sampled, nothing but the row's sampling and table needed) of a row the
            # workers hold: tested inline, once per request per step.
            if (sent is not None and len(step.token_ids) == 1 and step.sample and not step.return_logits
                    and not step.output_token_counts and not step.distinct_prompt_token_ids
                    and not step.suppressed_token_ids and not step.prompt_logprob_token_ids
                    and step.dp_rank == sent.dp_rank
                    and (step.sampling is sent.sampling or step.sampling == sent.sampling)
                    and step.num_generated - step.start_position == sent.offset):
                grown = len(table) - sent.num_blocks
                if 0 <= grown <= 1 and (sent.num_blocks == 0 or table[sent.num_blocks - 1] == sent.last_block):
                    add_slot(sent.slot)
                    add_kind(0)
                    add_position(step.start_position)
                    add_token(step.token_ids[0])
                    if grown:
                        add_block(table[-1])
                        sent.num_blocks += 1
                        sent.last_block = table[-1]
                    else:
                        add_block(-1)
                    continue
            if sent is None:
                slot = self._free_slots.pop() if self._free_slots else self._new_slot()
                sent = rows[step.request_id] = _Sent(slot, step.sampling, 0, 0, 0, -1)
            sent.sampling, sent.dp_rank = step.sampling, step.dp_rank
            sent.offset = step.num_generated - step.start_position
            sent.num_blocks, sent.last_block = len(table), table[-1] if table else -1
            slots.append(sent.slot)
            kinds.append(1)
            positions.append(0)
            tokens.append(0)
            new_blocks.append(-1)
            full.append(step.to_pb())
        freed, self._freed = self._freed, array("i")
        return worker_pb2.StepRequest(
            step_id=step_id, sequences=full, commit_expert_map=commit_expert_map,
            rows=worker_pb2.StepRows(epoch=self.epoch, slots=slots.tobytes(), kinds=bytes(kinds),
                                     positions=positions.tobytes(), tokens=tokens.tobytes(),
                                     new_blocks=new_blocks.tobytes(), freed=freed.tobytes()))

    def _new_slot(self) -> int:
        self._num_slots += 1
        return self._num_slots - 1


@dataclass(slots=True)
class _Row:
    """A row a worker holds: what its decode steps reuse."""

    request_id: str
    table: tuple[int, ...]
    sampling: SamplingParams
    dp_rank: int
    offset: int


class RowTable:
    """The worker's side: its rows by slot, and the steps of each request in order (one reader: the steps are
    decoded in the order they arrive, before the model thread runs them)."""

    def __init__(self) -> None:
        self.epoch = 0
        self._rows: dict[int, _Row] = {}

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def steps(self, request: worker_pb2.StepRequest) -> tuple[SequenceStep, ...]:
        """The request's SequenceSteps, in order (the full form, or the delta form over the rows held here)."""
        if not request.HasField("rows"):
            return tuple(SequenceStep.from_pb(s) for s in request.sequences)
        packed = request.rows
        if packed.epoch != self.epoch:
            self._rows.clear()
            self.epoch = packed.epoch
        for slot in array("i", packed.freed):
            self._rows.pop(slot, None)
        slots, positions, tokens = array("i", packed.slots), array("i", packed.positions), array("i", packed.tokens)
        new_blocks, kinds = array("i", packed.new_blocks), packed.kinds
        full = iter(request.sequences)
        steps = []
        for i, slot in enumerate(slots):
            if kinds[i]:
                step = SequenceStep.from_pb(next(full))
                self._rows[slot] = _Row(step.request_id, step.block_table, step.sampling, step.dp_rank,
                                        step.num_generated - step.start_position)
            else:
                row = self._rows.get(slot)
                if row is None:
                    raise UnknownRow(f"step {request.step_id} names row {slot}, which this worker does not hold in "
                                     f"epoch {packed.epoch}")
                if new_blocks[i] >= 0:
                    row.table += (new_blocks[i],)
                position = positions[i]
                step = SequenceStep(row.request_id, (tokens[i],), position, row.table, row.sampling, True, False,
                                    position + row.offset, dp_rank=row.dp_rank)
            steps.append(step)
        return tuple(steps)


def rows_result(output: StepOutput, steps: tuple[SequenceStep, ...]) -> worker_pb2.StepResult:
    """A step's result for a step sent in the delta form: the sampled tokens as one packed array in row order, and
    only the outputs carrying more than a token in `results`."""
    sampled = {o.request_id: o.token_id for o in output.outputs}
    tokens = array("i", [sampled.get(s.request_id, -1) for s in steps])
    extras = [o.to_pb() for o in output.outputs if o.logits or o.logprob is not None or o.prompt_logprobs]
    return worker_pb2.StepResult(step_id=output.step_id, rank=output.rank, results=extras, error=output.error,
                                 compute_seconds=output.compute_seconds, forward_seconds=output.forward_seconds,
                                 head_seconds=output.head_seconds, tokens=tokens.tobytes())


def sampled_tokens(result: worker_pb2.StepResult) -> list[int] | None:
    """The packed tokens of a delta-form result (row order, -1: none), None for a full-form one."""
    return array("i", result.tokens).tolist() if result.tokens else None


def extra_outputs(result: worker_pb2.StepResult) -> tuple[SequenceOutput, ...]:
    return tuple(SequenceOutput.from_pb(r) for r in result.results)
