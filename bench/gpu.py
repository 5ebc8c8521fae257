"""Decode on one GPU: reconfig next to transformers, the memory bound beside them, and a live switch's downtime.

    python3 bench/gpu.py [--batch-sizes 1,16,64] [--new-tokens 64] [--hf-compile] [--out DIR]

On a CUDA machine (../shared/gpu/README.md), in one run:
1. the copy ceiling: device-to-device GB/s (bytes read + written), so the memory bound of batch-1 decode is
   ceiling / weight bytes (every weight read once per step);
2. a 1B-shaped Llama (hidden 2048, 16 layers, 32/8 heads, intermediate 8192, vocab 32000, bf16, random weights)
   saved with save_pretrained, as the shard loader reads it;
3. transformers `generate` (greedy, prompt 64, exactly --new-tokens new tokens): eager with its dynamic cache, and
   with a static cache (eager; compiled too with --hf-compile: torch.compile costs minutes of device time);
4. reconfig's worker step in process (ModelRunner over the paged KV cache, greedy on the GPU): decode steps as
   CUDA graphs (with torch's kernels and with --kernels triton's) and eagerly, tok/s over the decode steps alone;
   then prefill: 8 prompts of 2,048 tokens in one step, both kernel sets beside transformers' SDPA forward
   (bench/gpu_prefill.py);
5. reconfig's serving path: a LocalCluster of 2 workers sharing the GPU (tp1pp1, one on standby) behind the router's
   engine over gRPC, concurrent requests, tok/s from submission to the last token (prefill included, as
   `generate`'s), with async scheduling (the default) and with the router waiting for each step's tokens;
6. tp1pp1 -> tp1pp2 -> tp1pp1 in place (all inside the freeze), then the same two switches staged (the target
   built, its KV pre-copied and its decode graphs captured while serving), each with 16 requests of its own
   streaming: each switch's downtime and phases; for a staged one, the streams' mean gap between tokens while it
   staged and pre-copied over their gap before it, - 1 ("TPOT while staging");
7. MoE decode (tiny-moe and a 1.7B Qwen3-MoE shape, batch 1 and 16): torch's product per expert eagerly, the
   grouped experts eagerly and graphed (bench/gpu_moe.py), last so that a run out of time keeps the rest.
Prints a markdown table, writes JSON and a plot next to it (bench/results/ by default).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

import gpu_moe  # noqa: E402  (bench/gpu_moe.py: the moe part)
import gpu_prefill  # noqa: E402  (bench/gpu_prefill.py: the prefill part)

SHAPE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=8192, vocab_size=32000, max_position_embeddings=4096)
PROMPT_LEN = 64
TOKEN = "bench-gpu"


def log(message: str) -> None:
    print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def copy_ceiling_gbps(num_bytes: int = 2 << 30, repeats: int = 20) -> float:
    """Device-to-device copy, GB/s counting bytes read plus bytes written (median of `repeats`)."""
    import torch

    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times = sorted(times[3:])
    return 2 * num_bytes / times[len(times) // 2] / 1e9


def make_checkpoint(directory: Path) -> tuple[Path, int]:
    """The 1B-shaped Llama, random weights (std 0.02), bf16; returns its directory and weight bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPE, torch_dtype="bfloat16", tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    from services.model.presets import resolve_model  # the router needs a tokenizer: the tiny preset's (ids < 32000)

    for name in ("tokenizer.json", "tokenizer_config.json"):
        source = Path(resolve_model("tiny-llama")) / name
        if source.exists():
            (directory / name).write_bytes(source.read_bytes())
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return directory, num_bytes


def prompts(batch: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, SHAPE["vocab_size"]) for _ in range(PROMPT_LEN)] for _ in range(batch)]


def bench_transformers(model_dir: Path, batches: list[int], new_tokens: int, compile_batches: list[int]) -> dict:
    """tok/s of `generate` per (variant, batch)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    results: dict = {}
    variants = [("hf_eager", {}), ("hf_static", {"cache_implementation": "static", "disable_compile": True})]
    if compile_batches:
        variants.append(("hf_static_compiled", {"cache_implementation": "static"}))
    for name, kwargs in variants:
        for batch in batches:
            if name == "hf_static_compiled" and batch not in compile_batches:
                continue
            ids = torch.tensor(prompts(batch, batch), device="cuda")
            run = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       **kwargs)
            try:
                model.generate(ids, **{**run, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up (and compile)
                if name == "hf_static_compiled":
                    model.generate(ids, **run)
                torch.cuda.synchronize()
                started = time.perf_counter()
                out = model.generate(ids, **run)
                torch.cuda.synchronize()
                seconds = time.perf_counter() - started
                assert out.shape[1] == PROMPT_LEN + new_tokens
                results[f"{name}/{batch}"] = batch * new_tokens / seconds
                log(f"{name} batch {batch}: {results[f'{name}/{batch}']:.1f} tok/s")
            except Exception as error:  # one variant failing must not hide the others
                results[f"{name}/{batch}"] = None
                log(f"{name} batch {batch} failed: {error!r}")
    del model
    torch.cuda.empty_cache()
    return results


def bench_worker_step(model_dir: Path, batches: list[int], new_tokens: int) -> dict:
    """reconfig's ModelRunner in process: decode tok/s with CUDA graphs and eagerly (prefill excluded), the graphs
    with torch's kernels and with --kernels triton's (services/model/triton_kernels.py), side by side; how many
    sequences' greedy tokens differ between the two kernel sets (bf16 rounds apart)."""
    import torch

    from services.model.kernels import choose
    from services.model.layers import ShardLoader, SingleRankGroup
    from services.model.llama import ShardedCausalLM
    from services.model.spec import ModelSpec
    from services.topology import Topology, place
    from services.worker.kv_cache import KVCache
    from safetensors.torch import load_file

    device = torch.device("cuda")
    spec = ModelSpec.from_dir(model_dir)
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    placement = place(Topology(1, 1), spec.shape)
    wp = placement.workers[0]
    block_size = 16
    blocks_per_seq = -(-(PROMPT_LEN + new_tokens) // block_size)
    cache = KVCache(wp.layers, len(wp.kv_heads), spec.head_dim, block_size, torch.bfloat16, device,
                    num_blocks=max(batches) * blocks_per_seq)
    results: dict = {}
    tokens: dict = {}
    for kernels, graphs in (("torch", True), ("triton", True), ("torch", False)):
        name = ("reconfig_step_graphs" if graphs else "reconfig_step_eager") + ("_triton" if kernels != "torch" else "")
        try:
            model = ShardedCausalLM(spec, wp, ShardLoader(tensors.__getitem__, set(tensors), torch.bfloat16, device),
                                    SingleRankGroup(), kernels=choose(kernels, device))
            tokens[name] = _decode_runs(model, cache, placement, wp, device, graphs, name, batches, new_tokens,
                                        blocks_per_seq, results)
        except Exception:
            results[f"{name}_error"] = traceback.format_exc()
            log(f"{name} failed:\n{results[f'{name}_error']}")
        model = None
        torch.cuda.empty_cache()
    if "reconfig_step_graphs_triton" in tokens and "reconfig_step_graphs" in tokens:
        results["kernels_sequences_differing"] = {
            batch: sum(a != b for a, b in zip(tokens["reconfig_step_graphs"][batch],
                                              tokens["reconfig_step_graphs_triton"][batch])) for batch in batches}
    cache.close()
    torch.cuda.empty_cache()
    return results


def _decode_runs(model, cache, placement, wp, device, graphs: bool, name: str, batches: list[int], new_tokens: int,
                 blocks_per_seq: int, results: dict) -> dict[int, list[list[int]]]:
    """One runner's decode tok/s at each batch (into results); returns each batch's greedy tokens per sequence."""
    import torch

    from services.contracts.step import SequenceStep, StepBatch
    from services.worker.model_runner import ModelRunner

    runner = ModelRunner(model, cache, placement, wp, None, device, cuda_graphs=graphs)
    outputs = {}
    for batch in batches:
        tables = [tuple(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)]
        ps = prompts(batch, batch)
        out = runner.execute(StepBatch(0, tuple(SequenceStep(f"r{i}", tuple(p), 0, t)
                                                 for i, (p, t) in enumerate(zip(ps, tables)))), 0)
        last = [o.token_id for o in out.outputs]
        generated = [[t] for t in last]
        for step in range(1, new_tokens):
            if step == 3:  # untimed until here: the first decode step of a shape captures its graph
                torch.cuda.synchronize()
                started = time.perf_counter()
            seqs = tuple(SequenceStep(f"r{i}", (last[i],), PROMPT_LEN + step - 1, tables[i]) for i in range(batch))
            last = [o.token_id for o in runner.execute(StepBatch(step, seqs), 0).outputs]
            for row, t in zip(generated, last):
                row.append(t)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        results[f"{name}/{batch}"] = batch * (new_tokens - 3) / seconds
        log(f"{name} batch {batch}: {results[f'{name}/{batch}']:.1f} tok/s "
            f"({seconds / (new_tokens - 3) * 1e3:.2f} ms/step)")
        outputs[batch] = generated
    if runner.graphs is not None:
        results[f"{name}_capture_seconds"] = runner.graphs.capture_seconds
        results[f"{name}_num_graphs"] = runner.graphs.num_graphs
    return outputs


async def bench_serving(model_dir: Path, batches: list[int], new_tokens: int) -> dict:
    """The router's engine over gRPC to 2 workers sharing the GPU (tp1pp1 + a standby); then live switches."""
    from services.controller.state import ControllerConfig, ControllerState
    from services.controller.status import OperationState
    from services.controller.transaction import Reconfigurer
    from services.launch.cluster import ClusterConfig, LocalCluster
    from services.model.spec import ModelSpec
    from services.router.contracts import GenerationRequest
    from services.router.grpc_server import start_router_grpc
    from services.router.main import RouterConfig, build_engine

    results: dict = {}
    cluster = LocalCluster(ClusterConfig(model=str(model_dir), num_workers=2, topology="tp1pp1", device="cuda",
                                         gpus=(0,), gpu_sharing=True, kv_cache_bytes=2 << 30, block_size=16,
                                         env={"RECONFIG_LOG_LEVEL": "WARNING"}))
    started = time.perf_counter()
    cluster.start()
    results["stack_start_seconds"] = time.perf_counter() - started
    addresses = tuple(cluster.worker_addresses)
    engine = await build_engine(RouterConfig(worker_addresses=addresses, model_dir=str(cluster.model_dir),
                                             model_name="gpu-bench", max_num_seqs=256))
    server, port = await start_router_grpc(engine, "127.0.0.1", 0, TOKEN)
    state = ControllerState(ControllerConfig(token=TOKEN, worker_addresses=addresses, topology="tp1pp1",
                                             router_grpc_address=f"127.0.0.1:{port}", model_dir=str(cluster.model_dir)))
    await state.open()
    reconfigurer = Reconfigurer(state, ModelSpec.from_dir(cluster.model_dir), None, state.router_stub, TOKEN)

    async def consume(request, tokens: list[int], arrivals: list[float] | None = None) -> None:
        async for delta in engine.generate(request):
            tokens.extend(delta.token_ids)
            if arrivals is not None and delta.token_ids:
                arrivals.append(time.perf_counter())
            if delta.finish_reason in ("error", "abort"):
                raise RuntimeError(f"{request.request_id}: {delta.finish_reason}")

    try:
        # Async scheduling (the default: each decode's next step sent ahead), then the router waiting for each
        # step's tokens, on the same requests.
        served: dict[int, list[list[int]]] = {}
        for row, ahead in (("reconfig_serving", True), ("reconfig_serving_wait", False)):
            engine.scheduler.config = dataclasses.replace(engine.scheduler.config, async_scheduling=ahead)
            for batch in [1, *batches]:  # the first pass at batch 1 warms the stack up
                outputs = [[] for _ in range(batch)]
                began = time.perf_counter()
                await asyncio.gather(*(consume(GenerationRequest(f"b{batch}-{i}-{time.monotonic_ns()}", tuple(p),
                                                                 new_tokens), outputs[i])
                                       for i, p in enumerate(prompts(batch, batch))))
                seconds = time.perf_counter() - began
                assert all(len(o) == new_tokens for o in outputs)
                results[f"{row}/{batch}"] = batch * new_tokens / seconds
                if served.setdefault(batch, outputs) != outputs:  # reported, not fatal: issue 39 asks why
                    from divergence import divergence, first_token_margins

                    report = divergence(served[batch], outputs)
                    try:
                        report["margins"] = first_token_margins(cluster.model_dir, prompts(batch, batch),
                                                                 served[batch], outputs, report["first_positions"])
                    except Exception as error:  # noqa: BLE001 (the comparison stands without the margins)
                        report["margins_error"] = repr(error)
                    results[f"divergence/{batch}"] = report
                    log(f"batch {batch}: waiting for each step changed {report['sequences_differing']} of {batch} "
                        f"sequences (first at generated token {report['earliest']}, median {report['median']}); "
                        f"margins: {report.get('margins', report.get('margins_error'))}")
            for batch in batches:
                log(f"{row} batch {batch}: {results[f'{row}/{batch}']:.1f} tok/s")
        engine.scheduler.config = dataclasses.replace(engine.scheduler.config, async_scheduling=True)
        # Live switches, each with 16 requests of its own streaming (a staged switch serves through its staging
        # and pre-copy: one batch would end before the later switches).
        switches, streams = [], []
        for strategy, target in (("in-place", "tp1pp2"), ("in-place", "tp1pp1"), ("staged", "tp1pp2"),
                                 ("staged", "tp1pp1")):
            live, arrivals = [[] for _ in range(16)], [[] for _ in range(16)]
            tasks = [asyncio.ensure_future(consume(GenerationRequest(f"s-{strategy}-{target}-{i}", tuple(p),
                                                                     8 * new_tokens), live[i], arrivals[i]))
                     for i, p in enumerate(prompts(16, 99))]
            while min(len(t) for t in live) < 32:  # enough gaps before the switch to compare its staging with
                await asyncio.sleep(0.005)
            called = time.perf_counter()
            operation = await reconfigurer.reconfigure(target, strategy=strategy)
            if operation.state is not OperationState.SUCCEEDED:
                raise RuntimeError(f"switch to {target}: {operation.state.name}: {operation.error}")
            switches.append(dict(target=target, strategy=strategy, downtime_ms=operation.downtime_seconds * 1e3,
                                 live=sum(1 for t in tasks if not t.done()), precopy=operation.precopy,
                                 phases_ms={k: v * 1e3 for k, v in operation.phase_seconds.items()}))
            staging_s = sum(operation.phase_seconds.get(phase, 0.0) for phase in ("STAGING", "PRECOPY"))
            switches[-1]["tpot_overhead"] = staging_overhead(arrivals, called, called + staging_s)
            log(f"switch -> {target} ({strategy}): downtime {operation.downtime_seconds * 1e3:.0f} ms, "
                f"{switches[-1]['live']} requests live, KV pre-copy: {operation.precopy or '-'}, "
                f"TPOT while staging: {_signed(switches[-1]['tpot_overhead'])}")
            await asyncio.gather(*tasks)
            streams.append(live)
        # The same 16 prompts again without a switch: every switched batch must equal them.
        again = [[] for _ in range(16)]
        await asyncio.gather(*(consume(GenerationRequest(f"n{i}", tuple(p), 8 * new_tokens), again[i])
                               for i, p in enumerate(prompts(16, 99))))
        results["switch_streams_identical"] = all(live == again for live in streams)
        results["switches"] = switches
    finally:
        await engine.stop()
        await state.close()
        await server.stop(0)
        cluster.stop()
    return results


def bench_numerics(model_dir: Path, batch: int, new_tokens: int) -> dict:
    """Issue 39's question, answered by experiment: the same `batch` greedy bf16 requests served with async
    scheduling and with the router waiting for each step, in fast and in invariant numerics (one worker, eager in
    invariant mode). Parting in fast mode and not in invariant mode is batch variance; parting in invariant mode
    too is a defect of one path. Tok/s each way is the invariant mode's cost on this GPU (eager, no graphs)."""
    from divergence import serve_both_ways

    results = {}
    for numerics in ("fast", "invariant"):
        report = serve_both_ways(model_dir, prompts(batch, batch), new_tokens, "bfloat16", numerics, device="cuda",
                                 gpus=(0,))
        results[f"numerics/{numerics}"] = {k: v for k, v in report.items() if k not in ("ahead", "waiting")}
        log(f"numerics {numerics}, batch {batch}: async {report['ahead_tok_s']:.0f} tok/s, waiting "
            f"{report['waiting_tok_s']:.0f} tok/s; {report['divergence']['sequences_differing']} of {batch} "
            f"sequences differ (first at {report['divergence']['earliest']})")
    return results


def staging_overhead(arrivals: list[list[float]], begin: float, end: float) -> float | None:
    """Mean gap between two token deltas that arrived in [begin, end] (a switch's staging and pre-copy, while
    serving) over the mean gap of the same streams before `begin` (the source layout; their first 4 deltas left
    out, the batch was still filling), - 1. None without gaps on either side."""
    during, before = [], []
    for times in arrivals:
        for index in range(5, len(times)):
            gap = times[index] - times[index - 1]
            if times[index] < begin:
                before.append(gap)
            elif times[index - 1] >= begin and times[index] <= end:
                during.append(gap)
    if not during or not before:
        return None
    return (sum(during) / len(during)) / (sum(before) / len(before)) - 1


def _signed(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:+.0%}"


def table(result: dict, batches: list[int]) -> str:
    rows = ["hf_eager", "hf_static", "hf_static_compiled", "reconfig_step_eager", "reconfig_step_graphs",
            "reconfig_step_graphs_triton", "reconfig_serving", "reconfig_serving_wait"]
    labels = {"hf_eager": "transformers generate, eager", "hf_static": "transformers generate, static cache (eager)",
              "hf_static_compiled": "transformers generate, static cache (compiled)",
              "reconfig_step_eager": "reconfig worker step, eager", "reconfig_step_graphs":
              "reconfig worker step, CUDA graphs", "reconfig_step_graphs_triton":
              "reconfig worker step, CUDA graphs, --kernels triton", "reconfig_serving": "reconfig serving (engine + gRPC, graphs)",
              "reconfig_serving_wait": "reconfig serving, waiting for each step (no async scheduling)"}
    lines = [f"| decode tok/s | {' | '.join(f'batch {b}' for b in batches)} |",
             "|---|" + "---|" * len(batches)]
    for row in rows:
        values = [result.get(f"{row}/{b}") for b in batches]
        if any(v is not None for v in values):
            lines.append(f"| {labels[row]} | " + " | ".join(f"{v:,.1f}" if v else "—" for v in values) + " |")
    bound = result.get("memory_bound_tok_s")
    if bound:
        lines.append(f"| memory bound (weights read once per step) | {bound:,.0f} |" + " |" * (len(batches) - 1))
        for row in ("reconfig_step_graphs", "reconfig_step_graphs_triton", "reconfig_serving"):
            if result.get(f"{row}/1"):
                lines.append(f"\n{labels[row]}, batch 1: {result[f'{row}/1'] / bound:.1%} of the memory bound")
    for b in batches:
        fused, plain = result.get(f"reconfig_step_graphs_triton/{b}"), result.get(f"reconfig_step_graphs/{b}")
        if fused and plain:
            differing = result.get("kernels_sequences_differing", {}).get(b)
            lines.append(f"\nbatch {b}: graphed step, triton kernels ÷ torch kernels = {fused / plain:.2f}×"
                         + (f" ({differing} of {b} sequences' greedy tokens differ)" if differing is not None else ""))
        ours, theirs = result.get(f"reconfig_serving/{b}"), result.get(f"hf_static_compiled/{b}") or result.get(
            f"hf_static/{b}")
        if ours and theirs:
            lines.append(f"\nbatch {b}: reconfig serving ÷ transformers static cache = {ours / theirs:.2f}×")
        if ours and (waiting := result.get(f"reconfig_serving_wait/{b}")):
            lines.append(f"\nbatch {b}: async scheduling, serving ÷ waiting for each step = {ours / waiting:.2f}×")
    for switch in result.get("switches", []):
        phases = ", ".join(f"{k} {v:.0f}" for k, v in switch["phases_ms"].items())
        lines.append(f"\nswitch → {switch['target']} ({switch.get('strategy', 'in-place')}, shared GPU, "
                     f"{switch['live']} live): downtime "
                     f"{switch['downtime_ms']:.0f} ms ({phases} ms)"
                     + (f"; TPOT while staging {_signed(switch.get('tpot_overhead'))}"
                        if switch.get("strategy") == "staged" else ""))
    lines += gpu_prefill.lines(result)
    lines += gpu_moe.lines(result)
    if "switch_streams_identical" in result:
        lines.append(f"\nswitched streams identical to unswitched: {result['switch_streams_identical']}")
    for mode in ("fast", "invariant"):
        if report := result.get(f"numerics/{mode}"):
            lines.append(f"\n{mode} numerics, bf16, batch {report['batch']}: async {report['ahead_tok_s']:.0f} / "
                         f"waiting {report['waiting_tok_s']:.0f} tok/s; async and waiting differ in "
                         f"{report['divergence']['sequences_differing']} sequences")
    return "\n".join(lines)


def plot(result: dict, batches: list[int], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in ("hf_eager", "hf_static", "hf_static_compiled", "reconfig_step_eager",
                        "reconfig_step_graphs", "reconfig_step_graphs_triton", "reconfig_serving",
                        "reconfig_serving_wait")
            if any(result.get(f"{r}/{b}") for b in batches)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(rows))
    for i, row in enumerate(rows):
        ax.bar([x + i * width for x in range(len(batches))], [result.get(f"{row}/{b}") or 0 for b in batches],
               width, label=row)
    if result.get("memory_bound_tok_s"):
        ax.axhline(result["memory_bound_tok_s"], color="k", linestyle="--", label="memory bound, batch 1")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_yscale("log")
    ax.set_ylabel("decode tok/s")
    ax.set_title(result.get("gpu", "GPU"))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hf-compile", default="", help="batch sizes to run compiled transformers at, e.g. 64")
    parser.add_argument("--skip", default="", help="parts to skip: numerics,hf,step,prefill,moe,serving")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    import torch

    batches = [int(b) for b in args.batch_sizes.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "batches": batches,
                    "new_tokens": args.new_tokens, "prompt_len": PROMPT_LEN}
    result["copy_gbps"] = copy_ceiling_gbps()
    log(f"device-to-device copy: {result['copy_gbps']:.0f} GB/s (read + written)")
    model_dir, weight_bytes = make_checkpoint(Path("/tmp/reconfig-gpu-bench/llama-1b"))
    result["weight_bytes"] = weight_bytes
    result["memory_bound_tok_s"] = result["copy_gbps"] * 1e9 / weight_bytes
    log(f"checkpoint: {weight_bytes / 1e9:.2f} GB; batch-1 memory bound {result['memory_bound_tok_s']:.0f} tok/s")
    parts = [("numerics", lambda: bench_numerics(model_dir, max(batches), args.new_tokens)),
             ("hf", lambda: bench_transformers(model_dir, batches, args.new_tokens,
                                               [int(b) for b in args.hf_compile.split(",") if b])),
             ("step", lambda: bench_worker_step(model_dir, batches, args.new_tokens)),
             ("prefill", lambda: gpu_prefill.bench_prefill(model_dir)),
             ("serving", lambda: asyncio.run(bench_serving(model_dir, batches, args.new_tokens))),
             ("moe", lambda: gpu_moe.bench_moe())]  # last: a lease that runs out keeps the parts above
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name, part in parts:
        if name in skip:
            continue
        started = time.perf_counter()
        try:
            result.update(part())
        except Exception:
            result[f"{name}_error"] = traceback.format_exc()
            log(f"part {name} failed:\n{result[f'{name}_error']}")
        result[f"{name}_seconds"] = time.perf_counter() - started
        # after every part: a run its time limit stops keeps what it measured
        (args.out / f"gpu-{stamp}.json").write_text(json.dumps(result, indent=2, default=str))
    text = table(result, batches)
    plot(result, batches, args.out / f"gpu-{stamp}.png")
    print(f"\n# reconfig on {result['gpu']} (torch {result['torch']})\n\n{text}\n")


if __name__ == "__main__":
    main()
