"""The GPU path on one CUDA device (issue 18): greedy equality with transformers with decode steps as CUDA graphs
and eagerly, several workers sharing the GPU (gloo collectives, host-staged point-to-point), 16 streams through a
chain of live switches with two rollbacks first, and kill -9 of a worker under load.

Run by hand where CUDA is (../shared/gpu/README.md); skipped elsewhere (conftest.py)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import numpy as np
import pytest
import torch

from services.controller.recovery import Recoverer
from services.controller.status import OperationState
from services.launch.cluster import ClusterConfig, LocalCluster
from services.launch.generate import generate
from services.model.spec import ModelSpec
from services.contracts.step import GREEDY, PENDING_TOKEN, SamplingParams, SequenceStep, StepBatch
from services.router.contracts import GenerationRequest
from services.router.driver import Driver
from services.topology import Topology, place, plan_kv_migration
from tests.conftest import hf_greedy, make_checkpoint, until
from tests.reconfigure.conftest import generated_tokens, open_live_stack, serve_alone_together_and_switched
from tests.reconfigure.helpers import background, wait_for_recovery
from tests.worker.helpers import in_process_runner

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5], list(range(20, 41)), [150, 7, 99, 12, 3]]
NUM_NEW_TOKENS = 24
LOGITS_ATOL = 2e-4  # fp32 on the GPU (no TF32) against fp32 on the CPU


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Llama style, 3 layers, 4 query / 2 KV heads (tp4 replicates KV), fp32."""
    return make_checkpoint(tmp_path_factory.mktemp("gpu") / "llama-gpu", "llama", seed=5)


def _cluster(checkpoint, num_workers: int, topology: str, kv_cache_bytes: int = 1 << 20, **kwargs) -> LocalCluster:
    return LocalCluster(ClusterConfig(model=str(checkpoint), num_workers=num_workers, topology=topology,
                                      device="cuda", gpus=(0,), gpu_sharing=num_workers > 1,
                                      kv_cache_bytes=kv_cache_bytes, block_size=4, collective_timeout_s=30, **kwargs))


LAYOUTS = [(1, "tp1pp1", False, "torch"), (1, "tp1pp1", True, "torch"), (2, "tp2pp1", False, "torch"),
           (4, "tp2pp2", False, "torch"), (1, "tp1pp1", False, "triton"), (2, "tp2pp1", False, "triton")]


@pytest.mark.parametrize("num_workers,topology,eager,kernels", LAYOUTS,
                         ids=["tp1pp1-graphs", "tp1pp1-eager", "tp2pp1-shared", "tp2pp2-shared",
                              "tp1pp1-graphs-triton", "tp2pp1-shared-triton"])
def test_greedy_equals_transformers(checkpoint, num_workers, topology, eager, kernels):
    ref_tokens, ref_logits = hf_greedy(checkpoint, PROMPTS, NUM_NEW_TOKENS)

    async def run():
        async with Driver(cluster.worker_addresses) as driver:
            # one request at a time (prefill, then batch-1 decode) and all together (a padded batch of 4)
            alone = [(await generate(driver, [p], NUM_NEW_TOKENS))[0].token_ids for p in PROMPTS[:2]]
            return alone, await generate(driver, PROMPTS, NUM_NEW_TOKENS, return_logits=True), driver.infos

    with _cluster(checkpoint, num_workers, topology, enforce_eager=eager, kernels=kernels) as cluster:
        alone, results, infos = asyncio.run(run())
    assert all(info.device.startswith("cuda") and info.kernels == kernels for info in infos)
    assert alone == ref_tokens[:2]
    for i, result in enumerate(results):
        assert result.token_ids == ref_tokens[i], f"prompt {i}"
        np.testing.assert_allclose(np.stack(result.logits), ref_logits[i].numpy(), atol=LOGITS_ATOL, rtol=0)


def _second_layer(checkpoint, start: str, target: str) -> int:
    shape = ModelSpec.from_dir(checkpoint).shape
    old, new = place(Topology.parse(start), shape), place(Topology.parse(target), shape)
    return plan_kv_migration(old, range(old.topology.num_workers), new, range(new.topology.num_workers)).layers()[1]


CHAIN = ["tp2pp2", "tp4pp1", "tp1pp2", "tp2pp1", "tp1pp1"]


async def test_streams_survive_rollbacks_and_a_chain_of_live_switches(checkpoint):
    """tp1pp1 (CUDA graphs) on one of 4 workers sharing the GPU: the first switch is refused by a worker, the
    second fails migrating a layer (both roll back), then the chain runs; 16 greedy streams stay exact."""
    faults = (f"apply:rank=1:action=raise:once=1;"
              f"migrate:rank=0:layer={_second_layer(checkpoint, 'tp1pp1', 'tp2pp2')}:once=1")
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 30))] for _ in range(16)]
    # Long enough to outlive the chain: a staged switch serves through its staging and pre-copy rounds.
    lengths = [rng.randrange(150, 220) for _ in prompts]
    expected, _ = hf_greedy(checkpoint, prompts, max(lengths))
    rows = []
    with _cluster(checkpoint, 4, "tp1pp1", kv_cache_bytes=4 << 20, faults=faults) as cluster:
        async with open_live_stack(cluster, leave_in=None) as stack:
            engine = stack.engine
            tasks = [asyncio.ensure_future(generated_tokens(engine, GenerationRequest(f"r{i}", tuple(p), n)))
                     for i, (p, n) in enumerate(zip(prompts, lengths))]
            await until(lambda: engine.stats().num_generation_tokens >= 3 * len(prompts), timeout_s=120,
                        what="every stream under way")
            for expected_error in ("refused before any KV moved", "rolled back (layers ["):
                operation = await stack.reconfigurer.reconfigure("tp2pp2")
                assert operation.state is OperationState.ROLLED_BACK, operation
                assert expected_error in operation.error
                assert str(engine.topology) == "tp1pp1"
                rows.append(("tp1pp1 -> tp2pp2 (fault)", operation))
            rows += await _switch_through(stack, CHAIN, tasks)
            outputs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            stats = engine.stats()
    assert stats.num_decodes_ahead > 0  # in tp1pp1 (CUDA graphs) the decodes went out a step ahead
    _check_and_report(outputs, expected, lengths, stats, rows)


async def _switch_through(stack, chain: list[str], tasks, label: str = "") -> list[tuple[str, object]]:
    """Switch the live stack through `chain` (the default strategy: staged) while `tasks` stream; every switch
    succeeds with requests in flight, its KV pre-copied through CUDA IPC while serving (to or from an EP layout:
    into the pools the router reserved in the target). Returns (name, operation) rows."""
    rows = []
    for target in chain:
        before = str(stack.engine.topology)
        operation = await stack.reconfigurer.reconfigure(target)
        assert operation.state is OperationState.SUCCEEDED, operation.error
        assert str(stack.engine.topology) == target and "STAGING" in operation.phase_seconds
        assert operation.precopy.endswith("rounds"), operation.precopy
        assert any(not t.done() for t in tasks), "a switch with nothing in flight proves nothing"
        rows.append((f"{before} -> {target}{label}", operation))
    return rows


def _check_and_report(outputs, expected, lengths, stats, rows) -> None:
    """Every stream equals the oracle, none was preempted or prefilled twice; print each switch's phases."""
    for i, tokens in enumerate(outputs):
        assert tokens == expected[i][: lengths[i]], f"request {i}"
    assert stats.num_preemptions == 0
    assert stats.extra["num_full_prefills"] == len(outputs)
    for name, operation in rows:
        phases = " ".join(f"{k}={v * 1e3:.0f}ms" for k, v in operation.phase_seconds.items())
        print(f"\nSWITCH | {name} | {operation.state.name} | downtime {operation.downtime_seconds * 1e3:.0f} ms | "
              f"{phases}")


async def test_kill9_of_a_worker_under_load(checkpoint):
    """tp2pp2 on 4 workers sharing the GPU; rank 1 is killed while 16 streams decode: the world re-forms on the
    survivors (tp1pp3), every request re-prefills once and ends with the oracle's tokens."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(4, 24))] for _ in range(16)]
    expected, _ = hf_greedy(checkpoint, prompts, 32)
    with _cluster(checkpoint, 4, "tp2pp2") as cluster:
        async with open_live_stack(cluster, leave_in=None, refresh_interval_s=0.2) as stack:
            engine, state = stack.engine, stack.state
            tasks = [asyncio.ensure_future(generated_tokens(engine, GenerationRequest(f"k{i}", tuple(p), 32)))
                     for i, p in enumerate(prompts)]
            async with background(state.run(), Recoverer(stack.reconfigurer).watch()):
                await until(lambda: engine.num_generation_tokens >= 3 * len(prompts), timeout_s=120,
                            what="every stream under way")
                killed_at = time.perf_counter()
                os.kill(cluster.worker_pids[1], signal.SIGKILL)
                recovered = await wait_for_recovery(state)
                outputs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
                topology = str(state.topology)
    assert recovered.state is OperationState.SUCCEEDED, recovered.error
    assert topology == "tp1pp3"
    for i, tokens in enumerate(outputs):
        assert tokens == expected[i], f"request {i}"
    print(f"\nKILL9 | rank 1 of tp2pp2 | recovered to {topology} in {time.perf_counter() - killed_at:.2f} s "
          f"(until every request ended) | 16/16 exact")


MOE_CHAIN = ["ep4pp1", "tp4pp1", "ep2pp2", "tp2pp2"]


async def test_moe_streams_through_staged_tp_ep_switches(tmp_path):
    """A Qwen3-MoE-style model on 4 workers sharing the GPU: 16 greedy streams through staged (the default)
    tp4 -> ep4 -> tp4 -> ep2pp2 -> tp2pp2, KV pools repartitioned between TP and EP on CUDA, pre-copied through
    CUDA IPC into the pools the router reserved; every stream ends with transformers' tokens, none re-prefilled."""
    checkpoint = make_checkpoint(tmp_path / "qwen3-moe", "qwen3_moe", seed=7)
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 30))] for _ in range(16)]
    lengths = [rng.randrange(60, 90) for _ in prompts]
    expected, _ = hf_greedy(checkpoint, prompts, max(lengths))
    with _cluster(checkpoint, 4, "tp4pp1") as cluster:
        async with open_live_stack(cluster, leave_in=None) as stack:
            engine = stack.engine
            tasks = [asyncio.ensure_future(generated_tokens(engine, GenerationRequest(f"m{i}", tuple(p), n)))
                     for i, (p, n) in enumerate(zip(prompts, lengths))]
            await until(lambda: engine.stats().num_generation_tokens >= 3 * len(prompts), timeout_s=120,
                        what="every stream under way")
            rows = await _switch_through(stack, MOE_CHAIN, tasks, " (MoE, staged)")
            outputs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            stats = engine.stats()
    _check_and_report(outputs, expected, lengths, stats, rows)


async def test_invariant_numerics_switches_change_no_token_of_64_bf16_streams(checkpoint):
    """Issue 39 on a GPU: four workers sharing it, bf16, invariant numerics (eager); 64 greedy streams through
    tp1pp1 -> tp2pp1 -> tp1pp2 -> tp2pp2 equal the same requests served together unswitched and each alone."""
    with _cluster(checkpoint, 4, "tp1pp1", kv_cache_bytes=8 << 20, dtype="bfloat16", numerics="invariant") as cluster:
        async with open_live_stack(cluster, leave_in=None) as stack:
            alone, together, switched = await serve_alone_together_and_switched(stack, 64,
                                                                                ["tp2pp1", "tp1pp2", "tp2pp2"], 32)
    assert [tokens[:32] for tokens in together] == alone
    assert switched == together


SAMPLED = (SamplingParams(temperature=0.8, seed=11, num_logprobs=2), SamplingParams(temperature=1.0, top_k=5, seed=12),
           SamplingParams(temperature=0.7, top_p=0.9, seed=13),
           SamplingParams(temperature=0.0, logit_bias=((7, 1.5), (150, -3.0))))  # greedy over processed logits


def _steps_ahead(runner, sampling, tables, sync_debug: bool, return_logits: bool = False) -> list[list[int]]:
    """Prefill PROMPTS, then NUM_NEW_TOKENS decode steps, each sent ahead (PENDING_TOKEN) before the previous
    step's tokens are read; with sync_debug, torch raises on any host synchronisation in a launch after the
    graph's capture. return_logits: every row asks for its logits too (the host's sampling)."""
    got = [[] for _ in PROMPTS]
    prefill = tuple(SequenceStep(f"r{i}", tuple(p), 0, t, sampling[i])
                    for i, (p, t) in enumerate(zip(PROMPTS, tables)))
    launched = runner.launch(StepBatch(0, prefill), 0)
    for step in range(1, NUM_NEW_TOKENS + 1):
        seqs = tuple(SequenceStep(f"r{i}", (PENDING_TOKEN,), len(p) + step - 1, t, sampling[i],
                                  num_generated=step, return_logits=return_logits)
                     for i, (p, t) in enumerate(zip(PROMPTS, tables)))
        if step > 2 and sync_debug:  # steps 1 and 2 capture the graph (a capture synchronises)
            torch.cuda.set_sync_debug_mode("error")
        try:
            ahead = runner.launch(StepBatch(step, seqs), 0) if step < NUM_NEW_TOKENS else None
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for i, out in enumerate(launched.result().outputs):  # the step before, read back after this launch
            got[i].append(out.token_id)
        launched = ahead
    return got


def test_sampled_steps_ahead_draw_on_the_device_what_the_host_draws(checkpoint):
    """Temperature, top-k, top-p (seeded; one with logprobs) beside a greedy row with a logit bias: the steps sent
    ahead process and draw on the device with no host synchronisation, the same tokens as the host's way draws
    from the same logits (return_logits)."""
    runner = in_process_runner(ModelSpec.from_dir(checkpoint), checkpoint, True, device=torch.device("cuda"))
    try:
        tables = [tuple(range(i * 16, (i + 1) * 16)) for i in range(len(PROMPTS))]
        on_device = _steps_ahead(runner, SAMPLED, tables, sync_debug=True)
        tables = [tuple(range(64 + i * 16, 64 + (i + 1) * 16)) for i in range(len(PROMPTS))]
        on_host = _steps_ahead(runner, SAMPLED, tables, sync_debug=False, return_logits=True)
    finally:
        runner.kv_cache.close()
    assert on_device == on_host


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_a_step_ahead_launches_without_waiting_for_the_device(checkpoint, kernels):
    """Issue 37 part 3: a greedy decode step sent ahead (PENDING_TOKEN inputs) launches through its CUDA graph with
    no host synchronisation (torch's sync debug mode raises on one): its tokens come from the previous step's, on
    the device, and reach the host only in result(). The tokens equal transformers'. Issue 38: with the Triton
    kernels inside the graph too."""
    expected, _ = hf_greedy(checkpoint, PROMPTS, NUM_NEW_TOKENS)
    runner = in_process_runner(ModelSpec.from_dir(checkpoint), checkpoint, True, device=torch.device("cuda"),
                               kernels=kernels)
    try:
        tables = [tuple(range(i * 16, (i + 1) * 16)) for i in range(len(PROMPTS))]
        got = _steps_ahead(runner, (GREEDY,) * len(PROMPTS), tables, sync_debug=True)
    finally:
        runner.kv_cache.close()
    assert runner.graphs.num_graphs >= 1
    assert got == expected


def test_an_eager_steps_attention_metadata_goes_up_without_a_host_synchronisation():
    """AttentionMetadata.build on CUDA for a step of prefill chunks and decodes (the eager path's): every host list
    goes up through pinned memory (services/model/device_io.py), so the host never waits for the queued steps."""
    from services.model.attention import AttentionMetadata

    device = torch.device("cuda")
    tables = [[3, 4, 5], [7], [9, 10], [11, 12, 13]]
    torch.cuda.set_sync_debug_mode("error")
    try:
        meta = AttentionMetadata.build([0, 5, 17, 30], [20, 1, 1, 9], tables, 16, device)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert meta.prefill_batch is not None and meta.decodes is not None
    assert meta.slot_mapping.device.type == "cuda" and meta.slot_mapping.shape == (31,)
