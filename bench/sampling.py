"""The sampler's cost per step: every row drawn at once in tensor ops (services/worker/sampler.py's sample_tensor,
since 2026-12-04) against the loop over rows it replaced (a softmax, top-k / sort and torch.multinomial per row,
kept below as `per_row`), side by side on the same logits, batch 1-64, one vocabulary.

    python3 bench/sampling.py [--vocab 49152] [--batches 1,16,64] [--device cpu] [--out DIR]

Prints a table (ms per step, best of --repeats), writes JSON and a plot. On a GPU (--device cuda) the batched way
also never waits for the device (the per-row way reads every token back): see tests/gpu/test_gpu.py."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from services.contracts.step import SamplingParams  # noqa: E402
from services.worker.sampler import sample_tensor  # noqa: E402

CASES = {"temperature 0.8": SamplingParams(temperature=0.8, seed=1),
         "top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9, seed=1),
         "top-k 50": SamplingParams(temperature=0.8, top_k=50, seed=1)}


def per_row(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int]) -> list[int]:
    """The sampler before 2026-12-04: one row at a time, a generator per seeded row."""
    tokens = logits.max(dim=-1).indices.tolist()
    for i, p in enumerate(params):
        row = (logits[i] / p.temperature).nan_to_num(nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
        if p.top_k > 0 and p.top_k < row.numel():
            row = row.masked_fill(row < torch.topk(row, p.top_k).values[-1], float("-inf"))
        if 0.0 < p.top_p < 1.0:
            ordered, order = torch.sort(row, descending=True)
            probs = ordered.softmax(-1)
            drop = probs.cumsum(-1) - probs >= p.top_p
            row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        generator = torch.Generator(device=logits.device).manual_seed(p.seed * 1_000_003 + num_generated[i])
        tokens[i] = int(torch.multinomial(row.softmax(-1), 1, generator=generator))
    return tokens


def _best_ms(run, device: torch.device, repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152)  # smollm2's
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args()
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    results: dict = {"vocab": args.vocab, "device": str(device), "torch_threads": torch.get_num_threads()}
    lines = [f"| ms per step ({device}, vocab {args.vocab}) | batch | per row (before) | all rows at once | ratio |",
             "|---|---|---|---|---|"]
    for name, params in CASES.items():
        for batch in batches:
            logits = torch.randn(batch, args.vocab, generator=torch.Generator().manual_seed(batch)).to(device) * 4
            rows, generated = [params] * batch, list(range(batch))
            before = _best_ms(lambda: per_row(logits, rows, generated), device, args.repeats)
            after = _best_ms(lambda: sample_tensor(logits, rows, generated).tolist(), device, args.repeats)
            results[f"{name}/{batch}"] = {"per_row_ms": before, "batched_ms": after}
            lines.append(f"| {name} | {batch} | {before:.2f} | {after:.2f} | {before / after:.1f}× |")
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (args.out / f"sampling-{stamp}.json").write_text(json.dumps(results, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name in CASES:
            ax.plot(batches, [results[f"{name}/{b}"]["per_row_ms"] for b in batches], "o--", label=f"{name}, per row")
            ax.plot(batches, [results[f"{name}/{b}"]["batched_ms"] for b in batches], "o-", label=f"{name}, batched")
        ax.set_xlabel("batch")
        ax.set_ylabel("ms per step")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.out / f"sampling-{stamp}.png")
    except ImportError:
        pass


if __name__ == "__main__":
    main()
