"""lm-evaluation-harness as a judge: its `local-completions` model against `reconfig up`, its `hf` model on the same
checkpoint, on tasks shipped in bench/tasks/ (no dataset or model hub).

    python bench/evaluate.py [--model smollm2-135m] [--tasks reconfig_mc] [--limit N]

Prints a table (accuracy on each side, the largest per-item |Δ log-likelihood|), writes JSON and a plot under
bench/results/. Exits non-zero unless every accuracy is identical and every item's log-likelihoods agree within
--tolerance.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack import REPO_ROOT, Stack  # noqa: E402  (stdlib only at import time)

TASKS_DIR = REPO_ROOT / "bench" / "tasks"
METRICS = ("acc", "acc_norm")


@dataclass(frozen=True, slots=True)
class EvalConfig:
    """What is evaluated, and how each side runs."""

    model: str
    tasks: tuple[str, ...]
    limit: int | None            # documents per task (None: all)
    batch_size: int              # requests per HTTP call (reconfig: a list of prompts) and per HF forward
    num_concurrent: int          # HTTP calls in flight
    topology: str | None         # `reconfig up` defaults when None
    num_workers: int | None
    tolerance: float             # largest allowed |Δ log-likelihood| per item
    out: Path


@dataclass(frozen=True, slots=True)
class TaskParity:
    """One task on both sides: accuracies, and the per-item log-likelihood comparison."""

    task: str
    num_docs: int
    num_requests: int            # log-likelihood requests (documents x choices)
    metrics_reconfig: dict[str, float]
    metrics_hf: dict[str, float]
    max_abs_diff: float
    num_greedy_differ: int       # requests whose is_greedy flag differs
    diffs: tuple[tuple[float, float], ...]  # (HF log-likelihood, reconfig - HF) per request

    def passes(self, tolerance: float) -> bool:
        return self.metrics_reconfig == self.metrics_hf and self.max_abs_diff <= tolerance


def evaluate(model: str, model_args: dict, config: EvalConfig) -> dict:
    """One lm-eval run (per-sample logs kept), on the tasks found in bench/tasks/."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=list(config.tasks), batch_size=config.batch_size,
        limit=config.limit, log_samples=True, task_manager=TaskManager(include_path=str(TASKS_DIR)),
        bootstrap_iters=0,
    )


def compare(task: str, reconfig: dict, hf: dict) -> TaskParity:
    """Item by item: same documents, same requests, log-likelihoods and greedy flags side by side."""
    def by_doc(results: dict) -> dict[int, dict]:
        return {sample["doc_id"]: sample for sample in results["samples"][task]}

    ours, theirs = by_doc(reconfig), by_doc(hf)
    if ours.keys() != theirs.keys():
        raise SystemExit(f"{task}: the two runs scored different documents")
    diffs, num_greedy_differ = [], 0
    for doc_id, sample in ours.items():
        other = theirs[doc_id]
        if sample["arguments"] != other["arguments"]:
            raise SystemExit(f"{task} doc {doc_id}: the two runs built different requests")
        for (mine,), (reference,) in zip(sample["resps"], other["resps"], strict=True):
            diffs.append((float(reference[0]), float(mine[0]) - float(reference[0])))
            num_greedy_differ += mine[1] != reference[1]

    def metrics(results: dict) -> dict[str, float]:
        values = results["results"][task]
        return {name: values[f"{name},none"] for name in METRICS if f"{name},none" in values}

    return TaskParity(task, len(ours), len(diffs), metrics(reconfig), metrics(hf),
                      max(abs(d) for _, d in diffs), num_greedy_differ, tuple(diffs))


def format_table(parities: list[TaskParity], config: EvalConfig, versions: dict) -> str:
    lines = ["| task | items | requests | " + " | ".join(f"{m} reconfig | {m} hf" for m in METRICS)
             + " | max \\|Δ loglik\\| | is_greedy differs | parity |",
             "|---|---:|---:|" + "---:|" * (2 * len(METRICS)) + "---:|---:|---|"]
    for p in parities:
        values = " | ".join(f"{p.metrics_reconfig.get(m, float('nan')):.4f} | {p.metrics_hf.get(m, float('nan')):.4f}"
                            for m in METRICS)
        lines.append(f"| {p.task} | {p.num_docs} | {p.num_requests} | {values} | {p.max_abs_diff:.2e} | "
                     f"{p.num_greedy_differ} | {'✓' if p.passes(config.tolerance) else '✗'} |")
    lines += ["", f"Notes: {config.model}; lm-eval {versions['lm_eval']}, transformers {versions['transformers']}. "
              f"reconfig: `local-completions` (tokenized requests, batch {config.batch_size}, {config.num_concurrent} "
              f"in flight) against `reconfig up`; hf: `hf` (float32, cpu, batch {config.batch_size}). Parity: "
              f"identical accuracies and every |Δ loglik| <= {config.tolerance:g}."]
    return "\n".join(lines)


def plot(parities: list[TaskParity], path: Path, title: str) -> None:
    """Per request: reconfig's log-likelihood minus HF's, against HF's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.2))
    for p in parities:
        axis.scatter([x for x, _ in p.diffs], [d for _, d in p.diffs], s=10, label=f"{p.task} ({p.num_requests})")
    axis.axhline(0.0, color="grey", linewidth=0.8)
    axis.set_xlabel("log-likelihood of the choice (hf)")
    axis.set_ylabel("reconfig - hf")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def parse_args(argv: list[str] | None = None) -> EvalConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="preset or checkpoint directory")
    parser.add_argument("--tasks", default="reconfig_mc", help="comma-separated, from bench/tasks/ or lm-eval's")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-concurrent", type=int, default=2)
    parser.add_argument("--topology", default=None, help="reconfig up's --topology (default: its own)")
    parser.add_argument("--workers", type=int, default=None, help="reconfig up's --workers")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest |Δ loglik| per item")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results" / "evaluate.json")
    args = parser.parse_args(argv)
    return EvalConfig(args.model, tuple(t.strip() for t in args.tasks.split(",")), args.limit, args.batch_size,
                      args.num_concurrent, args.topology, args.workers, args.tolerance, args.out)


def main(argv: list[str] | None = None) -> None:
    # No hub: the tasks' data ship in bench/tasks/, the model is the local checkpoint directory.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from services.logs import configure_logging
    from services.model.presets import resolve_model

    configure_logging("bench", "WARNING")
    config = parse_args(argv)
    started = time.perf_counter()
    model_dir = str(resolve_model(config.model))
    timings = {}
    print(f"evaluate: {config.model} on {', '.join(config.tasks)}: hf", file=sys.stderr, flush=True)
    hf = evaluate("hf", {"pretrained": model_dir, "dtype": "float32", "device": "cpu"}, config)
    timings["hf_s"] = time.perf_counter() - started
    print("evaluate: reconfig up + local-completions", file=sys.stderr, flush=True)
    with Stack(config.model, config.topology, config.num_workers) as stack:
        began = time.perf_counter()
        reconfig = evaluate("local-completions", {
            "model": stack.info["model"], "base_url": f"{stack.base_url}/v1/completions", "tokenizer": model_dir,
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": config.num_concurrent,
        }, config)
        timings["reconfig_s"] = time.perf_counter() - began
        topology = stack.info["topology"]
    parities = [compare(task, reconfig, hf) for task in config.tasks]

    import lm_eval
    import transformers

    versions = {"lm_eval": lm_eval.__version__, "transformers": transformers.__version__,
                "python": platform.python_version()}
    table = format_table(parities, config, versions)
    print(table)
    config.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"bench": "evaluate", "config": {**asdict(config), "out": str(config.out)}, "topology": topology,
               "versions": versions, "timings": timings, "wall_seconds": time.perf_counter() - started,
               "table": table, "tasks": [asdict(p) | {"passes": p.passes(config.tolerance)} for p in parities]}
    config.out.write_text(json.dumps(payload, indent=1) + "\n")
    plot_path = config.out.with_suffix(".png")
    plot(parities, plot_path, f"{config.model} ({topology}): lm-eval log-likelihoods, reconfig vs hf")
    print(f"\nwrote {config.out} and {plot_path} in {payload['wall_seconds']:.0f}s", file=sys.stderr)
    failed = [p.task for p in parities if not p.passes(config.tolerance)]
    if failed:
        raise SystemExit(f"parity failed on {', '.join(failed)}")


if __name__ == "__main__":
    main()
