"""Prefill tok/s: reconfig's worker step (torch's kernels and --kernels triton's) beside transformers' SDPA forward,
the same prompts in one batch. bench/gpu.py runs it as its `prefill` part (8 prompts of 2,048 tokens on a GPU);

    python3 bench/gpu_prefill.py --model DIR [--batch 8] [--prompt-len 2048] [--device cuda]

runs it alone (on a CPU too, a tiny model: the triton kernels then run in Triton's interpreter, a check of the
script, not a measurement)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _best_seconds(run, device, repeats: int) -> float:
    run()  # warm-up: kernels compile, the allocator settles
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return best


def bench_prefill(model_dir: Path, device_name: str = "cuda", batch: int = 8, prompt_len: int = 2048,
                  kernels: tuple[str, ...] = ("torch", "triton"), repeats: int = 3) -> dict:
    """{"prefill/<name>": tok/s} for transformers (SDPA) and each kernel set, best of `repeats` runs."""
    import torch
    from safetensors.torch import load_file

    from services.contracts.step import SequenceStep, StepBatch
    from services.model.kernels import choose
    from services.model.layers import ShardLoader, SingleRankGroup
    from services.model.llama import ShardedCausalLM
    from services.model.spec import ModelSpec
    from services.topology import Topology, place
    from services.worker.kv_cache import KVCache
    from services.worker.model_runner import ModelRunner

    device = torch.device(device_name)
    chosen = {name: choose(name, device) for name in kernels}  # before transformers, which may import triton
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    spec = ModelSpec.from_dir(model_dir)
    ids = torch.randint(3, spec.vocab_size, (batch, prompt_len), generator=generator)
    results: dict = {"prefill_batch": batch, "prefill_prompt_len": prompt_len}

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    with torch.no_grad():
        on_device = ids.to(device)
        seconds = _best_seconds(lambda: hf(on_device, use_cache=True), device, repeats)
    results["prefill/hf_sdpa"] = batch * prompt_len / seconds
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()

    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    placement = place(Topology(1, 1), spec.shape)
    wp = placement.workers[0]
    block_size = 16
    blocks = -(-prompt_len // block_size)
    cache = KVCache(wp.layers, len(wp.kv_heads), spec.head_dim, block_size, dtype, device,
                    num_blocks=batch * blocks)
    step = StepBatch(0, tuple(SequenceStep(f"r{i}", tuple(ids[i].tolist()), 0,
                                           tuple(range(i * blocks, (i + 1) * blocks))) for i in range(batch)))
    first_tokens = {}
    for name in kernels:
        model = ShardedCausalLM(spec, wp, ShardLoader(tensors.__getitem__, set(tensors), dtype, device),
                                SingleRankGroup(), kernels=chosen[name])
        runner = ModelRunner(model, cache, placement, wp, None, device, cuda_graphs=False)
        seconds = _best_seconds(lambda: runner.execute(step, 0), device, repeats)
        results[f"prefill/reconfig_{name}"] = batch * prompt_len / seconds
        first_tokens[name] = [o.token_id for o in runner.execute(step, 0).outputs]
        del model, runner
        if device.type == "cuda":
            torch.cuda.empty_cache()
    cache.close()
    if len(first_tokens) > 1:
        tokens = list(first_tokens.values())
        results["prefill_first_tokens_differing"] = sum(a != b for a, b in zip(tokens[0], tokens[1]))
    return results


def lines(result: dict) -> list[str]:
    """The table's prefill lines (bench/gpu.py prints them under its decode table)."""
    hf = result.get("prefill/hf_sdpa")
    if not hf:
        return []
    out = [f"\nprefill, {result['prefill_batch']} prompts of {result['prefill_prompt_len']} tokens in one step, "
           f"tok/s: transformers SDPA {hf:,.0f}"]
    for name in ("torch", "triton"):
        if ours := result.get(f"prefill/reconfig_{name}"):
            out.append(f"; reconfig, {name} kernels {ours:,.0f} ({ours / hf:.2f}× transformers)")
    if "prefill_first_tokens_differing" in result:
        out.append(f"; first tokens differing between the kernel sets: {result['prefill_first_tokens_differing']}")
    return ["".join(out)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = bench_prefill(args.model, args.device, args.batch, args.prompt_len, repeats=args.repeats)
    print(json.dumps(result, indent=2))
    print("\n".join(lines(result)))


if __name__ == "__main__":
    main()
