"""Steps sent ahead (async scheduling): a worker feeds PENDING_TOKEN with the token its previous step sampled for
the request there, on the eager path and the fixed-shape decode path, and refuses one it did not sample."""

from __future__ import annotations

import contextlib

import pytest

from services.contracts.step import PENDING_TOKEN, SamplingParams, SequenceStep, StepBatch
from services.model.spec import ModelSpec
from services.topology import Topology
from services.worker.model_runner import PendingTokenMissing
from tests.conftest import hf_greedy, make_checkpoint
from tests.worker.helpers import in_process_runner


@contextlib.contextmanager
def runner_of(model_dir, graphs: bool, topology: Topology = Topology(1, 1)):
    runner = in_process_runner(ModelSpec.from_dir(model_dir), model_dir, graphs, topology)
    try:
        yield runner
    finally:
        runner.kv_cache.close()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode-graphs"])
def test_pending_tokens_are_the_ones_sampled_the_step_before(tmp_path, graphs):
    model_dir = make_checkpoint(tmp_path / "llama", "llama", seed=5)
    prompts = [[5, 6, 7, 8, 9], [3, 4], list(range(20, 33))]
    tables = [tuple(range(0, 8)), tuple(range(8, 16)), tuple(range(16, 24))]
    num_new = 8
    expected, _ = hf_greedy(model_dir, prompts, num_new)
    outputs = [[] for _ in prompts]
    seqs = tuple(SequenceStep(f"r{i}", tuple(p), 0, t) for i, (p, t) in enumerate(zip(prompts, tables)))
    with runner_of(model_dir, graphs) as runner:
        for step in range(num_new):
            result = runner.execute(StepBatch(step, seqs), 0)
            for i, out in enumerate(result.outputs):
                outputs[i].append(out.token_id)
            # Every input of the next step pending, except r1's on odd steps (the router knew that one already).
            seqs = tuple(SequenceStep(f"r{i}", (outputs[i][-1],) if i == 1 and step % 2 else (PENDING_TOKEN,),
                                      len(p) + step, t) for i, (p, t) in enumerate(zip(prompts, tables)))
    assert outputs == expected


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode-graphs"])
def test_pending_tokens_follow_their_request_when_rows_move(tmp_path, graphs):
    """The tokens stay on the device, by row: a step ahead whose rows come in another order, or fewer of them,
    or beside a request it did not sample, still feeds each request its own token."""
    model_dir = make_checkpoint(tmp_path / "llama", "llama", seed=5)
    prompts = {"a": [5, 6, 7, 8, 9], "b": [3, 4], "c": list(range(20, 33))}
    tables = {"a": tuple(range(0, 8)), "b": tuple(range(8, 16)), "c": tuple(range(16, 24))}
    expected = dict(zip(prompts, hf_greedy(model_dir, list(prompts.values()), 5)[0]))
    orders = [("a", "b", "c"), ("c", "a", "b"), ("b", "c"), ("c", "b", "a"), ("a", "c", "b")]
    got = {name: [] for name in prompts}
    with runner_of(model_dir, graphs) as runner:
        for step, order in enumerate(orders):
            seqs = tuple(SequenceStep(name, tuple(prompts[name]) if step == 0 else
                                      (PENDING_TOKEN,) if name in orders[step - 1] else (got[name][-1],),
                                      0 if step == 0 else len(prompts[name]) + len(got[name]) - 1, tables[name])
                         for name in order)
            for out in runner.execute(StepBatch(step, seqs), 0).outputs:
                got[out.request_id].append(out.token_id)
    # "a" sat step 2 out: step 3 feeds it the token the router holds, and "b" and "c" theirs, pending
    assert got == {name: expected[name][:len(got[name])] for name in got}
    assert [len(got[name]) for name in "abc"] == [4, 5, 5]


def test_a_pending_token_the_previous_step_did_not_sample_is_refused(tmp_path):
    model_dir = make_checkpoint(tmp_path / "llama", "llama", seed=5)
    table = tuple(range(0, 8))
    with runner_of(model_dir, False) as runner:
        runner.execute(StepBatch(0, (SequenceStep("a", (5, 6, 7), 0, table),)), 0)  # samples position 3
        with pytest.raises(PendingTokenMissing, match="position 4"):
            runner.execute(StepBatch(1, (SequenceStep("a", (PENDING_TOKEN,), 4, table),)), 0)
        with pytest.raises(PendingTokenMissing, match="'b'"):
            runner.execute(StepBatch(1, (SequenceStep("b", (PENDING_TOKEN,), 3, table),)), 0)
        # A step that did not sample it (a prefill chunk) comes between: the token is gone.
        runner.execute(StepBatch(2, (SequenceStep("c", (1, 2), 0, tuple(range(8, 16)), sample=False),)), 0)
        with pytest.raises(PendingTokenMissing):
            runner.execute(StepBatch(3, (SequenceStep("a", (PENDING_TOKEN,), 3, table),)), 0)


def test_a_pipeline_stage_refuses_pending_tokens(tmp_path):
    """Only the ranks of a single-stage layout sample what they feed: in a pipeline (or an EP layout) every rank
    refuses a pending token alike, before its first collective (a rank that resolved it would wait for the
    others)."""
    model_dir = make_checkpoint(tmp_path / "llama", "llama", seed=5)
    with runner_of(model_dir, False, Topology(1, 2)) as runner:
        with pytest.raises(PendingTokenMissing, match="single-stage"):
            runner.execute(StepBatch(0, (SequenceStep("a", (PENDING_TOKEN,), 3, tuple(range(8))),)), 0)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "decode-graphs"])
def test_sampled_steps_ahead_draw_what_the_hosts_sampler_draws(tmp_path, graphs):
    """Temperature, top-k and top-p rows (seeded), one with penalties, a logit bias and suppressed tokens, and a
    greedy one, two of them with logprobs, fed their own previous tokens: drawn on the device's way
    (logits_processor, sampler.sample_tensor, logprobs.logprob_tensors: no logits to the host), the same tokens and
    logprobs as the host's way gives (every row asks for its logits too)."""
    model_dir = make_checkpoint(tmp_path / "llama", "llama", seed=5)
    prompts = [[5, 6, 7, 8, 9], [3, 4], list(range(20, 33)), [40, 41], [50, 51, 52]]
    sampling = (SamplingParams(temperature=0.8, seed=11, num_logprobs=3),
                SamplingParams(temperature=1.5, top_k=5, seed=12),
                SamplingParams(temperature=1.2, top_p=0.9, seed=13), SamplingParams(temperature=0.0, num_logprobs=0),
                SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5,
                               logit_bias=((7, 1.5), (9, -2.0))))
    processed = dict(output_token_counts=((7, 2), (11, 1)), distinct_prompt_token_ids=(50, 51, 52),
                     suppressed_token_ids=(3,))  # the last row's (fixed: both ways see the same)
    num_new = 10
    drawn = {}
    with runner_of(model_dir, graphs) as runner:
        for way, offset in (("device", 0), ("host", 32)):
            tables = [tuple(range(offset + 8 * i, offset + 8 * (i + 1))) for i in range(len(prompts))]
            tokens, logprobs = [[] for _ in prompts], []
            seqs = tuple(SequenceStep(f"r{i}", tuple(p), 0, t, sampling[i])
                         for i, (p, t) in enumerate(zip(prompts, tables)))
            launched = runner.launch(StepBatch(0, seqs), 0)
            for step in range(1, num_new + 1):
                seqs = tuple(SequenceStep(f"r{i}", (PENDING_TOKEN,), len(p) + step - 1, t, sampling[i],
                                          num_generated=step, return_logits=way == "host",
                                          **(processed if i == len(prompts) - 1 else {}))
                             for i, (p, t) in enumerate(zip(prompts, tables)))
                ahead = runner.launch(StepBatch(step, seqs), 0) if step < num_new else None
                if step > 1:  # (the prefill asked for no logits either way)
                    assert len(launched.request_ids) == (len(prompts) if way == "device" else 0)  # on the device
                for row, out in zip(tokens, launched.result().outputs, strict=True):
                    row.append(out.token_id)
                    logprobs += [out.logprob] if out.logprob is not None else []
                launched = ahead
            drawn[way] = tokens, logprobs
    assert drawn["device"][0] == drawn["host"][0]
    for device_lp, host_lp in zip(drawn["device"][1], drawn["host"][1], strict=True):
        assert (device_lp is None) == (host_lp is None)
        if device_lp is not None:
            assert device_lp.token_id == host_lp.token_id
            assert [t for t, _ in device_lp.top] == [t for t, _ in host_lp.top]
            assert device_lp.logprob == pytest.approx(host_lp.logprob, abs=1e-6)
            assert [v for _, v in device_lp.top] == pytest.approx([v for _, v in host_lp.top], abs=1e-6)
    assert len(drawn["device"][1]) == 2 * num_new  # 2 rows asked, every step (the prefill's included)
    drawn = {way: tokens for way, (tokens, _) in drawn.items()}
    assert all(len(set(row)) > 1 for row in drawn["device"][:3])  # they sampled


def test_prompt_logprobs_are_taken_on_the_device_as_the_host_takes_them(tmp_path):
    """A prefill chunk that only returns prompt logprobs and one that also samples (with logprobs): on the device's
    way (no logits to the host) the same outputs as the host's way gives when another row asks for its logits."""
    model_dir = make_checkpoint(tmp_path / "llama", "llama", seed=5)
    prompt = list(range(20, 33))
    asks = SamplingParams(temperature=0.9, seed=3, num_logprobs=2)
    outputs = {}
    with runner_of(model_dir, False) as runner:
        for way, offset in (("device", 0), ("host", 12)):
            seqs = (SequenceStep("chunk", tuple(prompt[:6]), 0, (offset, offset + 1), asks, sample=False,
                                 prompt_logprob_token_ids=tuple(prompt[1:7])),
                    SequenceStep("last", tuple(prompt), 0, tuple(range(offset + 2, offset + 6)), asks,
                                 prompt_logprob_token_ids=tuple(prompt[1:])),
                    SequenceStep("other", (5, 6, 7), 0, (offset + 6,), return_logits=way == "host"))
            launched = runner.launch(StepBatch(0, seqs), 0)
            assert bool(launched.prompt) == (way == "device")
            outputs[way] = {o.request_id: o for o in launched.result().outputs}
    device, host = outputs["device"], outputs["host"]
    assert [o.request_id for o in outputs["device"].values()] == ["chunk", "last", "other"]  # batch order
    for request_id in ("chunk", "last"):
        d, h = device[request_id], host[request_id]
        assert d.token_id == h.token_id and len(d.prompt_logprobs) == len(h.prompt_logprobs) > 0
        for a, b in zip(d.prompt_logprobs + (d.logprob,) * (d.logprob is not None),
                        h.prompt_logprobs + (h.logprob,) * (h.logprob is not None), strict=True):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-6)
    assert device["chunk"].token_id == -1 and device["last"].logprob is not None
