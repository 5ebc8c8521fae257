"""The fixed-shape decode step that CUDA graphs replay (services/worker/decode_graphs.py), run eagerly on CPU: the
same tokens, logits and KV bytes as the variable-shape step, with padded batches, key buckets crossed mid-run and
padding rows that must not touch any slot but their real row's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.contracts.step import SamplingParams, SequenceStep, StepBatch
from services.model.spec import ModelSpec
from services.worker.decode_graphs import MIN_KEYS, DecodeGraphs, batch_bucket, key_blocks
from services.worker.kv_cache import KVCache
from tests.conftest import hf_greedy, make_checkpoint
from tests.worker.helpers import CPU, RUNNER_BLOCK_SIZE, RUNNER_NUM_BLOCKS, in_process_runner


def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 17, 64, 65, 256)] == [1, 2, 4, 8, 24, 64, 96, 256]
    assert batch_bucket(257) is None
    assert key_blocks(1, 4) == MIN_KEYS // 4
    assert key_blocks(MIN_KEYS, 16) == MIN_KEYS // 16
    assert key_blocks(MIN_KEYS + 1, 16) == 2 * MIN_KEYS // 16
    assert key_blocks(1000, 16) == 1024 // 16


@pytest.mark.parametrize("style", ["llama", "qwen2"])
def test_fixed_shape_decode_equals_the_variable_shape_step(tmp_path, style):
    model_dir = make_checkpoint(tmp_path / style, style, seed=3)
    spec = ModelSpec.from_dir(model_dir)
    eager, fixed = in_process_runner(spec, model_dir, False), in_process_runner(spec, model_dir, True)
    # Three requests (a padded batch of 4): one crosses from the 128-key bucket into the 256-key one mid-run.
    prompts = [list(range(3, 3 + 122)), [7, 8, 9], list(range(40, 60))]
    num_new = 12
    tables = [tuple(range(0, 40)), tuple(range(40, 48)), tuple(range(48, 60))]  # blocks 60..95 stay unused
    expected, _ = hf_greedy(model_dir, prompts, num_new)
    outputs = {id(eager): [[] for _ in prompts], id(fixed): [[] for _ in prompts]}
    try:
        for runner in (eager, fixed):
            seqs = tuple(SequenceStep(f"r{i}", tuple(p), 0, t) for i, (p, t) in enumerate(zip(prompts, tables)))
            for i, out in enumerate(runner.execute(StepBatch(0, seqs), 0).outputs):
                outputs[id(runner)][i].append(out.token_id)
        for step in range(1, num_new):
            steps = []
            for runner in (eager, fixed):
                tokens = outputs[id(runner)]
                seqs = tuple(SequenceStep(f"r{i}", (tokens[i][-1],), len(p) + step - 1, t,
                                          return_logits=step % 3 == 0 and i == 1)  # some steps take the logits path
                             for i, (p, t) in enumerate(zip(prompts, tables)))
                result = runner.execute(StepBatch(step, seqs), 0)
                steps.append(result)
                for i, out in enumerate(result.outputs):
                    tokens[i].append(out.token_id)
            for a, b in zip(*(s.outputs for s in steps), strict=True):
                assert a.request_id == b.request_id and a.token_id == b.token_id
                if a.logits:
                    np.testing.assert_allclose(np.frombuffer(b.logits, np.float32),
                                               np.frombuffer(a.logits, np.float32), atol=1e-5, rtol=0)
        assert outputs[id(fixed)] == expected and outputs[id(eager)] == expected
        assert fixed.graphs.num_graphs == 2  # (4 rows, 128 keys) then (4 rows, 256 keys)
        for a, b in zip(eager.kv_cache.layers, fixed.kv_cache.layers, strict=True):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)  # GEMMs of 3 and 4 rows round apart
            assert not b[:, 60:].any(), "a padding row wrote outside its real row's slots"
    finally:
        eager.kv_cache.close()
        fixed.kv_cache.close()


def test_what_a_graph_refuses(tmp_path):
    model_dir = make_checkpoint(tmp_path / "llama", "llama", seed=1)
    spec = ModelSpec.from_dir(model_dir)
    runner = in_process_runner(spec, model_dir, True)
    try:
        graphs = runner.graphs
        decode = SequenceStep("a", (5,), 3, (0,))
        assert graphs.accepts([decode])
        assert not graphs.accepts([])
        assert not graphs.accepts([SequenceStep("a", (5, 6), 0, (0,))])  # a prefill
        assert not graphs.accepts([SequenceStep("a", (5,), 3, (0,), prompt_logprob_token_ids=(5,))])
        assert not graphs.accepts([decode] * 257)
        assert runner.graph_support() == "not on a GPU"
        sampled = SequenceStep("a", (5,), 0, (0,), SamplingParams(temperature=0.8, seed=1))
        assert graphs.accepts([sampled])  # sampling runs on the graph's logits
    finally:
        runner.kv_cache.close()


def test_graphs_of_a_runner_built_before_its_kv_arrives(tmp_path):
    """A switch builds the new runner over an empty KV cache that the migration then fills layer by layer; the
    graphs bind to the KV tensors at first use, and drop themselves when a layer tensor is replaced."""
    model_dir = make_checkpoint(tmp_path / "llama", "llama", seed=2)
    spec = ModelSpec.from_dir(model_dir)
    full = in_process_runner(spec, model_dir, True)
    wp = full.wp
    empty = KVCache(wp.layers, len(wp.kv_heads), spec.head_dim, RUNNER_BLOCK_SIZE, torch.float32, CPU,
                    num_blocks=RUNNER_NUM_BLOCKS, allocate=False)
    try:
        graphs = DecodeGraphs(full.model, empty, CPU, capture=False)
        for layer in wp.layers:
            empty.set_layer(layer, empty.new_layer())
        step = [SequenceStep("a", (5,), 0, (0,))]
        graphs.run(step, None)
        assert graphs.num_graphs == 1
        replaced = empty.pop_layer(wp.layers[0])
        empty.set_layer(wp.layers[0], empty.new_layer())
        replaced.free()
        graphs.run(step, None)
        assert graphs.num_graphs == 1  # dropped, then the one shape met again
        assert graphs._kv_ptrs == tuple(t.data_ptr() for t in empty.layers)
    finally:
        full.kv_cache.close()
        empty.close()


def test_graphs_captured_ahead_over_the_layers_a_staged_pool_will_hold(tmp_path):
    """A staged switch captures the target's graphs before the cutover, over the tensors its pool will hold: its
    own layers and the ones the live pool hands over at the commit. Once the pool holds them, nothing is
    recaptured; a different tensor still drops the graphs."""
    model_dir = make_checkpoint(tmp_path / "llama", "llama", seed=2)
    spec = ModelSpec.from_dir(model_dir)
    live = in_process_runner(spec, model_dir, False)
    wp = live.wp
    kept = wp.layers[0]  # a layer the target keeps as it is: still the live pool's until the commit
    staged = KVCache(wp.layers, len(wp.kv_heads), spec.head_dim, RUNNER_BLOCK_SIZE, torch.float32, CPU,
                     num_blocks=RUNNER_NUM_BLOCKS, allocate=False)
    try:
        for layer in wp.layers[1:]:
            staged.set_layer(layer, staged.new_layer())
        future = [live.kv_cache.layer(kept).tensor] + [staged.layer(layer).tensor for layer in wp.layers[1:]]
        graphs = DecodeGraphs(live.model, staged, CPU, capture=False)
        assert graphs.warm((1, 2), layers=future) == 2
        assert graphs.warm((1, 2), layers=future) == 0  # already there
        staged.set_layer(kept, live.kv_cache.pop_layer(kept))  # the commit
        step = [SequenceStep("a", (5,), 0, (0,))]
        graphs.run(step, None)
        assert graphs.num_graphs == 2  # bound to these tensors since the warm: kept
        assert graphs._kv_ptrs == tuple(t.data_ptr() for t in staged.layers)
        # The step wrote row 0's key into block 0 of the kept tensor, which the graph addresses now.
        assert staged.layer(kept).tensor[0, 0, 0].abs().sum() > 0
        replaced = staged.pop_layer(kept)
        staged.set_layer(kept, staged.new_layer())
        replaced.free()
        graphs.run(step, None)
        assert graphs.num_graphs == 1  # dropped, then the one shape met again
    finally:
        live.kv_cache.close()
        staged.close()


@pytest.mark.parametrize("ahead", [False, True], ids=["tokens-known", "tokens-pending"])
def test_decodes_stay_on_the_graph_when_a_prefill_arrives(tmp_path, ahead):
    """A step of decodes and prefill chunks runs its decodes through their graph and the chunks eagerly, one after
    the other (issue 37 part 5): every request still gets transformers' tokens, fed pending or not, and each
    decode row went through the graph."""
    model_dir = make_checkpoint(tmp_path / "llama", "llama", seed=3)
    prompts = [[5, 6, 7, 8, 9], [3, 4], list(range(20, 33)), list(range(40, 51))]
    tables = [tuple(range(i * 8, (i + 1) * 8)) for i in range(len(prompts))]
    num_new = 6
    expected, _ = hf_greedy(model_dir, prompts, num_new)
    runner = in_process_runner(ModelSpec.from_dir(model_dir), model_dir, graphs=True)
    graph_rows = []
    run = runner.graphs.run
    runner.graphs.run = lambda seqs, *args: graph_rows.append(len(seqs)) or run(seqs, *args)
    got = [[] for _ in prompts]
    late = prompts[3]  # arrives at step 2, in two chunks: 6 tokens that do not sample, then the rest
    try:
        for step in range(num_new + 3):
            seqs = []
            for i, p in enumerate(prompts[:3]):
                if step == 0:
                    seqs.append(SequenceStep(f"r{i}", tuple(p), 0, tables[i]))
                elif len(got[i]) < num_new:
                    token = (got[i][-1],) if not ahead else (-1,)
                    seqs.append(SequenceStep(f"r{i}", token, len(p) + len(got[i]) - 1, tables[i]))
            if step == 2:
                seqs.insert(1, SequenceStep("r3", tuple(late[:6]), 0, tables[3], sample=False))
            elif step == 3:
                seqs.append(SequenceStep("r3", tuple(late[6:]), 6, tables[3]))
            elif step > 3 and len(got[3]) < num_new:
                seqs.append(SequenceStep("r3", (-1,) if ahead else (got[3][-1],), len(late) + len(got[3]) - 1,
                                         tables[3]))
            result = runner.execute(StepBatch(step, tuple(seqs)), 0)
            assert [o.request_id for o in result.outputs] == [s.request_id for s in seqs if s.sample]  # batch order
            for out in result.outputs:
                got[int(out.request_id[1:])].append(out.token_id)
    finally:
        runner.kv_cache.close()
    assert got == expected
    assert graph_rows[:3] == [3, 3, 3]  # steps 1-3: the decodes on the graph, beside r3's chunks
    assert graph_rows[3] == 4  # then r3 decodes with them
