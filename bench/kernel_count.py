"""Device kernels per decode step: torch's kernels against --kernels triton's, counted on a CPU (issue 38's proxy).

    python3 bench/kernel_count.py [--layers 2] [--batch 4] [--context 80] [--dtype bfloat16] [--moe] [--out DIR]

A decode step replayed as a CUDA graph launches one device kernel per tensor op it recorded; the graph's time at
small batches is mostly their count (each a few µs of launch gap and a short tail), which is what issue 38's
fused kernels cut. This counts them where no GPU is: the fixed-shape decode step of a Llama-shaped model (the
1B bench model's heads and widths, fewer layers; and one layer, which gives the kernels outside the layers, so
per layer and the 16-layer model follow) runs once under a TorchDispatchMode that counts every aten op
that is not a view or an allocation (each would be a kernel on a GPU), plus every Triton kernel launch (run in
Triton's interpreter here). Both kernel sets, the same step, side by side: a table, JSON and a plot. The counts
depend on the model's structure, not on the device. --moe counts a Qwen3-MoE model of bench/gpu_moe.py's widths
instead (64 experts, top-8): there torch's kernels run a product per expert hit, after reading the experts' token
counts on the host (an eager step only: no graph can hold it), and --kernels triton two grouped GEMMs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# Allocations and metadata: no kernel on a GPU.
_NOT_KERNELS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
                "_to_copy_meta", "alias", "set_"}
SHAPE = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=8, intermediate_size=8192,
             vocab_size=32000, head_dim=64)


class KernelCounter(TorchDispatchMode):
    """Counts the aten ops that would launch a device kernel, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.paused = False  # inside an interpreted Triton kernel: its copies to and from numpy are not kernels

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in _NOT_KERNELS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def _count_triton_launches(counter: KernelCounter):
    """Patch the interpreter's launch to count each kernel by name; returns the undo."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.__getitem__

    def launch(self, grid):  # kernel[grid](...): one launch
        counter.ops[f"triton:{self.fn.__name__}"] += 1
        executor = original(self, grid)

        def run(*args, **kwargs):
            counter.paused = True
            try:
                return executor(*args, **kwargs)
            finally:
                counter.paused = False
        return run

    InterpretedFunction.__getitem__ = launch
    return lambda: setattr(InterpretedFunction, "__getitem__", original)


def make_model(directory: Path, layers: int, moe: bool = False) -> Path:
    import transformers

    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(0)
    if moe:
        sys.path.insert(0, str(REPO_ROOT / "bench"))
        from gpu_moe import QWEN3_MOE_1B

        config = transformers.Qwen3MoeConfig(**{**QWEN3_MOE_1B, "num_hidden_layers": layers})
        model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=layers, max_position_embeddings=4096, **SHAPE)
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def count_step(model_dir: Path, kernels: str, batch: int, context: int,
               dtype: torch.dtype = torch.bfloat16) -> collections.Counter:
    """The device kernels of one fixed-shape (graph) decode step of `batch` rows at `context` keys."""
    from services.contracts.step import SequenceStep, StepBatch
    from services.model.spec import ModelSpec
    from tests.worker.helpers import in_process_runner

    spec = ModelSpec.from_dir(model_dir)
    runner = in_process_runner(spec, model_dir, True, kernels=kernels, dtype=dtype)
    block_size = runner.kv_cache.block_size
    blocks = -(-(context + 1) // block_size)
    if batch * blocks > runner.kv_cache.num_blocks:
        raise ValueError(f"batch {batch} x {context} keys need {batch * blocks} KV blocks, the runner has "
                         f"{runner.kv_cache.num_blocks}")
    seqs = tuple(SequenceStep(f"r{i}", (5,), context, tuple(range(i * blocks, (i + 1) * blocks)))
                 for i in range(batch))
    try:
        # ModelRunner.launch runs under inference_mode, which hides its dtype casts (aten._to_copy, a kernel each)
        # from a dispatch mode: both steps under no_grad instead (the first builds the graph's input tensors)
        launch = type(runner).launch.__wrapped__
        with torch.no_grad():
            launch(runner, StepBatch(0, seqs), 0).result()
        counter = KernelCounter()
        undo = _count_triton_launches(counter)
        try:
            with counter, torch.no_grad():
                launch(runner, StepBatch(1, seqs), 0).result()
        finally:
            undo()
    finally:
        runner.kv_cache.close()
    return counter.ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=80)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the step's dtype (a GPU's bfloat16 by default: torch's float32 RMSNorm is one fused "
                             "op, its bfloat16 one several)")
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE model (bench/gpu_moe.py's widths)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.layers < 2:
        parser.error("--layers must be >= 2 (a 1-layer model's step gives the kernels outside the layers)")
    family = "qwen3-moe" if args.moe else "llama"
    model_dir = make_model(Path(f"/tmp/reconfig-kernel-count/{family}-{args.layers}l"), args.layers, args.moe)
    one_layer = make_model(Path(f"/tmp/reconfig-kernel-count/{family}-1l"), 1, args.moe)
    counts = {name: count_step(model_dir, name, args.batch, args.context, dtype) for name in ("torch", "triton")}
    single = {name: sum(count_step(one_layer, name, args.batch, args.context, dtype).values()) for name in counts}
    rows = sorted(set(counts["torch"]) | set(counts["triton"]), key=lambda op: -counts["torch"][op])
    lines = [f"| device kernels per decode step ({family}, {args.layers} layers, {args.dtype}, batch {args.batch}, "
             f"{args.context} keys) "
             "| torch kernels | triton kernels |", "|---|---|---|"]
    lines += [f"| {op} | {counts['torch'][op]} | {counts['triton'][op]} |" for op in rows]
    totals = {name: sum(ops.values()) for name, ops in counts.items()}
    lines.append(f"| **total** | **{totals['torch']}** | **{totals['triton']}** |")
    per_layer = {name: (totals[name] - single[name]) / (args.layers - 1) for name in counts}
    outside = {name: single[name] - per_layer[name] for name in counts}
    bench_model = {name: outside[name] + 16 * per_layer[name] for name in counts}  # bench/gpu.py's 16 layers
    lines.append(f"\ntriton ÷ torch kernels per step: {totals['triton'] / totals['torch']:.2f}; per layer "
                 f"{per_layer['torch']:.0f} -> {per_layer['triton']:.0f}, outside the layers {outside['torch']:.0f} "
                 f"-> {outside['triton']:.0f}; bench/gpu.py's 16-layer model: {bench_model['torch']:.0f} -> "
                 f"{bench_model['triton']:.0f} ({bench_model['triton'] / bench_model['torch']:.2f}×)")
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    result = {"model": family, "layers": args.layers, "dtype": args.dtype, "batch": args.batch,
              "context": args.context, "shape": SHAPE,
              "counts": {name: dict(ops) for name, ops in counts.items()}, "totals": totals,
              "per_layer": per_layer, "outside_layers": outside, "bench_model_16_layers": bench_model}
    (args.out / f"kernel-count-{stamp}.json").write_text(json.dumps(result, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        ax.barh(range(len(rows)), [counts["torch"][op] for op in rows], 0.4, label="torch kernels")
        ax.barh([i + 0.4 for i in range(len(rows))], [counts["triton"][op] for op in rows], 0.4,
                label="triton kernels")
        ax.set_yticks([i + 0.2 for i in range(len(rows))], rows, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("kernels in one decode step")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / f"kernel-count-{stamp}.png")
    except ImportError:
        pass


if __name__ == "__main__":
    main()
