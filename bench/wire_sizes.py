"""The bytes of a steady decode step on the wire between the router and a worker, built with the router's own
wire code (bench/serving_cpu.py reports them at several context lengths): the full form every step had before the
delta form (services/worker/step_rows.py), and the delta form once the rows are on the workers."""

from __future__ import annotations

BLOCK_SIZE = 16


def decode_step_bytes(batch: int, context: int) -> dict:
    """A decode step of `batch` requests, each `context` tokens into its KV: the request's bytes and the result's,
    in both forms."""
    from services.worker.step import SequenceOutput, SequenceStep, StepBatch, StepOutput
    from services.worker.step_rows import RowEncoder, rows_result

    def steps(position: int) -> tuple[SequenceStep, ...]:
        num_blocks = -(-(position + 1) // BLOCK_SIZE)
        return tuple(SequenceStep(request_id=f"cmpl-{i:032x}", token_ids=(1000 + i,), start_position=position,
                                  block_table=tuple(range(i * 1000, i * 1000 + num_blocks)),
                                  num_generated=position - 64) for i in range(batch))

    full_steps = steps(context)
    output = StepOutput(7, 0, tuple(SequenceOutput(s.request_id, 5) for s in full_steps))
    encoder = RowEncoder()
    encoder.encode(6, steps(context - 1))  # the rows reach the workers once
    delta_steps = steps(context)
    return dict(request_bytes=StepBatch(7, full_steps).to_pb().ByteSize(), result_bytes=output.to_pb().ByteSize(),
                delta_request_bytes=encoder.encode(7, delta_steps).ByteSize(),
                delta_result_bytes=rows_result(output, delta_steps).ByteSize())
