"""What the scheduler sends of a request's history for its sampling options: penalties' token counts, min_tokens'
suppressed stop tokens and the prompt logprob targets (echo), only for requests that use them, right across
chunked prefill and preemption by recompute; and prompt-only requests (max_tokens 0)."""

from __future__ import annotations

from services.contracts.step import SamplingParams, SequenceOutput, TokenLogprob
from services.router.contracts import GenerationRequest
from services.router.sequence import Sequence, SequenceStatus
from tests.router.fakes import PagedWorkers, make_scheduler, prompt_of


def _seq(request_id: str, prompt: list[int], max_tokens: int, **options) -> Sequence:
    return Sequence.from_request(GenerationRequest(request_id, tuple(prompt), max_tokens, **options))


def _outputs(batch, sampled: dict[str, int]) -> dict[str, SequenceOutput]:
    """Fake workers' logprobs: the logprob of a prompt target is -(its position)."""
    outputs = {}
    for item in batch.items:
        step = item.step
        prompt = tuple(TokenLogprob(token, -float(step.start_position + 1 + i))
                       for i, token in enumerate(step.prompt_logprob_token_ids))
        sampled_logprob = TokenLogprob(sampled[step.request_id], -0.5) if step.request_id in sampled else None
        outputs[step.request_id] = SequenceOutput(step.request_id, sampled.get(step.request_id, -1),
                                                  logprob=sampled_logprob, prompt_logprobs=prompt)
    return outputs


def _step(scheduler, workers):
    batch = scheduler.schedule()
    sampled = workers.run(batch)
    return batch, scheduler.on_batch_done(batch, sampled, _outputs(batch, sampled))


def test_penalty_history_and_suppression_are_sent_only_when_used():
    scheduler = make_scheduler()
    workers = PagedWorkers(scheduler.block_manager)
    penalized = SamplingParams(frequency_penalty=0.5, repetition_penalty=1.2)
    scheduler.add(_seq("plain", [1, 2, 3], 4))
    scheduler.add(_seq("pen", [5, 5, 6], 4, sampling=penalized))
    scheduler.add(_seq("min", [7, 8], 4, stop_token_ids=frozenset({9, 3}), min_tokens=2))
    for step_index in range(4):
        batch, _ = _step(scheduler, workers)
        steps = {item.seq.request_id: item.step for item in batch.items}
        seqs = {item.seq.request_id: item.seq for item in batch.items}
        plain = steps["plain"]
        assert (plain.output_token_counts, plain.distinct_prompt_token_ids, plain.suppressed_token_ids) == ((), (), ())
        pen, outputs = steps["pen"], seqs["pen"].output_token_ids[:step_index]
        assert pen.distinct_prompt_token_ids == (5, 6)
        assert pen.output_token_counts == tuple(sorted((t, outputs.count(t)) for t in set(outputs)))
        if "min" in steps:
            assert steps["min"].suppressed_token_ids == ((3, 9) if step_index < 2 else ())


def test_prompt_logprobs_follow_the_chunks_and_survive_a_preemption():
    prompt = prompt_of(3, 10)
    scheduler = make_scheduler(max_num_batched_tokens=4)
    workers = PagedWorkers(scheduler.block_manager)
    seq = _seq("echo", prompt, 2, prompt_logprobs=True)
    scheduler.add(seq)
    batch, _ = _step(scheduler, workers)  # positions 0-3 score prompt tokens 1-4
    assert batch.items[0].step.prompt_logprob_token_ids == tuple(prompt[1:5])
    scheduler.preempt(seq)  # recompute from position 0: the targets are asked again and rewritten in place
    batch, _ = _step(scheduler, workers)
    assert batch.items[0].step.start_position == 0
    assert batch.items[0].step.prompt_logprob_token_ids == tuple(prompt[1:5])
    _step(scheduler, workers)
    batch, updates = _step(scheduler, workers)  # the last chunk, positions 8-9: scores token 9, then samples
    assert batch.items[0].step.prompt_logprob_token_ids == (prompt[9],)
    assert [(p.token_id, p.logprob) for p in seq.prompt_logprobs] == [(t, -float(i + 1)) for i, t in
                                                                      enumerate(prompt[1:])]
    assert updates[0].logprobs == (TokenLogprob(seq.output_token_ids[0], -0.5),)
    batch, _ = _step(scheduler, workers)  # a decode: nothing more to score
    assert batch.items[0].step.prompt_logprob_token_ids == ()
    assert seq.status is SequenceStatus.FINISHED_LENGTH


def test_a_prompt_only_request_prefills_and_finishes_without_sampling():
    scheduler = make_scheduler(max_num_batched_tokens=4, num_blocks=2)
    workers = PagedWorkers(scheduler.block_manager)
    seq = _seq("score", prompt_of(1, 8), 0, prompt_logprobs=True)  # 8 tokens of KV: exactly 2 blocks
    scheduler.add(seq)
    batch, updates = _step(scheduler, workers)
    assert not batch.items[0].step.sample and updates[0].finished is False
    batch, updates = _step(scheduler, workers)
    assert not batch.items[0].step.sample
    assert updates[0].finished and updates[0].new_token_ids == () and seq.status is SequenceStatus.FINISHED_LENGTH
    assert seq.output_token_ids == [] and len(seq.prompt_logprobs) == 7
    assert not scheduler.has_unfinished and scheduler.block_manager.num_used == 0
