"""The bytes of a steady decode step on the wire between the router and a worker, built with the router's own
wire code (bench/serving_cpu.py reports them at several context lengths): the full form every step had before the
delta form (services/contracts/step_rows.py), and the delta form once the rows are on the workers."""

from __future__ import annotations

BLOCK_SIZE = 16


def decode_step_bytes(batch: int, context: int) -> dict:
    """A decode step of `batch` requests, each `context` tokens into its KV: the request's bytes and the result's,
    in both forms."""
    from services.contracts.step import SequenceOutput, SequenceStep, StepBatch, StepOutput
    from services.contracts.step_rows import RowEncoder, rows_result

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


def step_work_us(batch: int, num_steps: int = 300, prompt_len: int = 64) -> dict:
    """The host work of one steady decode step, in one process and CPU time (a proxy measured the same way in every
    session, on any machine; on a shared one it moves with the machine's speed: compare interleaved runs): the
    router's part (schedule with steps ahead, encode, apply the result) and the
    worker's (read the rows, pack the result), the model left out. Microseconds per step at `batch` requests."""
    import time

    from services.contracts.step import SequenceOutput, StepOutput
    from services.contracts.step_rows import RowEncoder, RowTable, rows_result
    from services.router.async_scheduler import AsyncScheduler
    from services.router.config import SchedulerConfig
    from services.router.dp_blocks import DataParallelBlocks
    from services.router.sequence import Sequence
    from services.rpc.reconfig.v1 import worker_pb2

    max_tokens = num_steps + 16
    scheduler = AsyncScheduler(SchedulerConfig(max_model_len=prompt_len + max_tokens, max_num_seqs=batch),
                               DataParallelBlocks(1, batch * (-(-(prompt_len + max_tokens) // BLOCK_SIZE)), BLOCK_SIZE))
    for i in range(batch):
        scheduler.add(Sequence(f"cmpl-{i:032x}", list(range(1, prompt_len + 1)), max_tokens=max_tokens))
    encoder, table = RowEncoder(), RowTable()
    clock = time.thread_time
    spent = {"router": 0.0, "worker": 0.0}

    def send():
        started = clock()
        batch_ = scheduler.schedule(1, ahead=True)
        payload = encoder.encode(batch_.batch_id, [item.step for item in batch_.items]).SerializeToString()
        routed = clock()
        steps = table.steps(worker_pb2.StepRequest.FromString(payload))
        output = StepOutput(batch_.batch_id, 0, tuple(SequenceOutput(s.request_id, 7) for s in steps))
        result = rows_result(output, steps).SerializeToString()
        spent["router"] += routed - started
        spent["worker"] += clock() - routed
        return batch_, result

    def apply(batch_, result) -> None:
        started = clock()
        output = StepOutput.from_pb(worker_pb2.StepResult.FromString(result))
        scheduler.on_batch_done(batch_, output.sampled([item.seq.request_id for item in batch_.items]), {})
        spent["router"] += clock() - started

    apply(*send())  # the prefill
    pending = send()
    for name in spent:
        spent[name] = 0.0
    for _ in range(num_steps):  # one step ahead in flight, as with async scheduling
        ahead = send()
        apply(*pending)
        pending = ahead
    return {f"{name}_us_per_step": round(1e6 * seconds / num_steps, 1) for name, seconds in spent.items()}
