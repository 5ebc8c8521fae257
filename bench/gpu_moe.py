"""MoE decode tok/s before and after the grouped experts (issue 38): the worker step of a sparse model eagerly with
torch's kernels (a product per expert, its token counts read on the host every layer: what ran before), eagerly
with --kernels triton (services/model/triton_moe.py's two grouped GEMMs) and as CUDA graphs with them (a TP
layout's MoE decode graphed). bench/gpu.py runs it as its `moe` part, on the tiny-moe preset and on a
Qwen3-MoE-shaped bf16 model of 1.7B parameters (hidden 1024, 16 layers, 64 experts of 512, top-8; random weights);

    python3 bench/gpu_moe.py [--models tiny-moe,qwen3-moe-1.7b] [--batch-sizes 1,16] [--device cuda]

runs it alone (on a CPU too, tiny-moe: the graph step then runs its fixed shapes eagerly and the triton kernels in
Triton's interpreter, a check of the script, not a measurement). Greedy tokens of the three runs are compared
(bf16 rounds apart; float32 on a CPU)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

QWEN3_MOE_1B = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                    head_dim=64, intermediate_size=2816, num_experts=64, num_experts_per_tok=8,
                    moe_intermediate_size=512, norm_topk_prob=True, vocab_size=32000, max_position_embeddings=4096)
VARIANTS = (("torch", False), ("triton", False), ("triton", True))  # (kernels, graphs)
PROMPT_LEN = 64


def variant_name(kernels: str, graphs: bool) -> str:
    return f"{kernels}_{'graphs' if graphs else 'eager'}"


def make_qwen3_moe(directory: Path, device) -> Path:
    """The Qwen3-MoE-shaped model, random weights (std 0.02), bf16, saved as the shard loader reads it."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN3_MOE_1B, torch_dtype="bfloat16")).to(torch.bfloat16)
    model.save_pretrained(directory)
    del model
    return directory


def model_dir(name: str, device) -> Path:
    from services.model.presets import resolve_model

    if name == "qwen3-moe-1.7b":
        return make_qwen3_moe(Path("/tmp/reconfig-gpu-bench") / name, device)
    return resolve_model(name)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _decode(runner, device, batch: int, new_tokens: int, vocab: int, blocks: int) -> tuple[float, list[list[int]]]:
    """Prefill `batch` prompts, then decode; (tok/s over the decode steps after the first 2, greedy tokens)."""
    import random

    from services.contracts.step import SequenceStep, StepBatch

    rng = random.Random(batch)
    prompts = [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(batch)]
    tables = [tuple(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    out = runner.execute(StepBatch(0, tuple(SequenceStep(f"r{i}", tuple(p), 0, t)
                                             for i, (p, t) in enumerate(zip(prompts, tables)))), 0)
    generated = [[o.token_id] for o in out.outputs]
    started = time.perf_counter()
    for step in range(1, new_tokens):
        if step == 3:  # untimed until here: a shape's first decode step captures its graph
            _sync(device)
            started = time.perf_counter()
        seqs = tuple(SequenceStep(f"r{i}", (generated[i][-1],), PROMPT_LEN + step - 1, tables[i])
                     for i in range(batch))
        for row, o in zip(generated, runner.execute(StepBatch(step, seqs), 0).outputs, strict=True):
            row.append(o.token_id)
    _sync(device)
    return batch * (new_tokens - 3) / (time.perf_counter() - started), generated


def bench_moe(device_name: str = "cuda", models: tuple[str, ...] = ("tiny-moe", "qwen3-moe-1.7b"),
              batches: tuple[int, ...] = (1, 16), new_tokens: int = 32) -> dict:
    """{"moe/<model>/<variant>/<batch>": tok/s, ...} for every model and VARIANTS; per model its parameters, the
    bytes a batch-1 step reads (attention, dense layers, lm_head and top-k experts), graphs captured or why none,
    and the sequences whose greedy tokens differ from the torch run's."""
    import torch
    from safetensors.torch import load_file

    from services.model.kernels import choose
    from services.model.layers import ShardLoader, SingleRankGroup
    from services.model.llama import ShardedCausalLM
    from services.model.spec import ModelSpec
    from services.topology import Topology, place
    from services.worker.decode_graphs import DecodeGraphs
    from services.worker.kv_cache import KVCache
    from services.worker.model_runner import ModelRunner

    device = torch.device(device_name)
    chosen = {name: choose(name, device) for name, _ in VARIANTS}  # before transformers may import triton
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results: dict = {"moe_models": list(models), "moe_batches": list(batches), "moe_new_tokens": new_tokens}
    for name in models:
        directory = model_dir(name, device)
        spec = ModelSpec.from_dir(directory)
        tensors = {}
        for path in sorted(directory.glob("*.safetensors")):
            tensors.update(load_file(path))
        results[f"moe/{name}/parameters"] = spec.num_parameters
        expert = 3 * spec.hidden_size * spec.moe_intermediate_size
        inactive = len(spec.moe_layers) * (spec.num_experts - spec.num_experts_per_tok) * expert
        results[f"moe/{name}/batch1_bytes"] = (spec.num_parameters - inactive) * (2 if dtype == torch.bfloat16 else 4)
        placement = place(Topology(1, 1), spec.shape)
        wp = placement.workers[0]
        block_size = 16
        blocks = -(-(PROMPT_LEN + new_tokens) // block_size)
        cache = KVCache(wp.layers, len(wp.kv_heads), spec.head_dim, block_size, dtype, device,
                        num_blocks=max(batches) * blocks)
        tokens = {}
        for kernels, graphs in VARIANTS:
            variant = variant_name(kernels, graphs)
            model = ShardedCausalLM(spec, wp, ShardLoader(tensors.__getitem__, set(tensors), dtype, device),
                                    SingleRankGroup(), kernels=chosen[kernels])
            runner = ModelRunner(model, cache, placement, wp, None, device, cuda_graphs=graphs)
            if graphs and device.type == "cpu":  # the fixed-shape step, eagerly (what the CPU tests check)
                runner.graphs = DecodeGraphs(model, cache, device, capture=False)
            if graphs and runner.graphs is None:
                results[f"moe/{name}/graphs_refused"] = runner.graphs_refused
            for batch in batches:
                rate, tokens[variant, batch] = _decode(runner, device, batch, new_tokens, spec.vocab_size, blocks)
                results[f"moe/{name}/{variant}/{batch}"] = rate
                print(f"{name} {variant} batch {batch}: {rate:,.1f} tok/s", file=sys.stderr, flush=True)
            if runner.graphs is not None:
                results[f"moe/{name}/num_graphs"] = runner.graphs.num_graphs
            del model, runner
            if device.type == "cuda":
                torch.cuda.empty_cache()
        cache.close()
        base = variant_name(*VARIANTS[0])
        for kernels, graphs in VARIANTS[1:]:
            variant = variant_name(kernels, graphs)
            results[f"moe/{name}/{variant}/differing"] = {
                batch: sum(a != b for a, b in zip(tokens[base, batch], tokens[variant, batch])) for batch in batches}
    return results


def lines(result: dict) -> list[str]:
    """The table's MoE part (bench/gpu.py prints it under its decode table)."""
    if "moe_models" not in result:
        return []
    batches = result["moe_batches"]
    out = ["", "MoE decode, worker step, tok/s (tp1; before: torch's kernels, a product per expert)", "",
           "| model | kernels, step | " + " | ".join(f"batch {b}" for b in batches) + " | vs before |",
           "|---|---|" + "---|" * len(batches) + "---|"]
    for name in result["moe_models"]:
        base = [result.get(f"moe/{name}/{variant_name(*VARIANTS[0])}/{b}") for b in batches]
        for kernels, graphs in VARIANTS:
            variant = variant_name(kernels, graphs)
            rates = [result.get(f"moe/{name}/{variant}/{b}") for b in batches]
            cells = [f"{r:,.0f}" if r else "–" for r in rates]
            ratio = ", ".join(f"{r / b:.2f}×" for r, b in zip(rates, base) if r and b)
            out.append(f"| {name} | {kernels}, {'graphs' if graphs else 'eager'} | {' | '.join(cells)} | {ratio} |")
        if refused := result.get(f"moe/{name}/graphs_refused"):
            out.append(f"\n{name}: no graphs ({refused})")
        differing = {v: result.get(f"moe/{name}/{variant_name(*v)}/differing") for v in VARIANTS[1:]}
        out.append(f"\n{name}: {result[f'moe/{name}/parameters'] / 1e9:.2f}B parameters, a batch-1 step reads "
                   f"{result[f'moe/{name}/batch1_bytes'] / 1e9:.3f} GB; sequences differing from before: "
                   + "; ".join(f"{variant_name(*v)} {d}" for v, d in differing.items()))
        if copy := result.get("copy_gbps"):
            graphed = result.get(f"moe/{name}/{variant_name(*VARIANTS[-1])}/1")
            bound = copy * 1e9 / result[f"moe/{name}/batch1_bytes"]
            if graphed:
                out.append(f"; batch 1 graphed at {graphed / bound:.1%} of its memory bound ({bound:,.0f} tok/s)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny-moe,qwen3-moe-1.7b")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = parser.parse_args()
    result = bench_moe(args.device, tuple(args.models.split(",")), tuple(int(b) for b in args.batch_sizes.split(",")),
                       args.new_tokens)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print("\n".join(lines(result)))


if __name__ == "__main__":
    main()
