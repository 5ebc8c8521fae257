"""`reconfig` command line: up, generate (offline batch inference on N sharded workers), demo, models, certs,
simulate."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

DEMO_PROMPTS = ["The layout of a serving system", "Tensor parallelism splits", "Hello, reconfig!"]


def _add_cluster_args(parser: argparse.ArgumentParser, workers: int, topology: str) -> None:
    parser.add_argument("--model", default="tiny-llama", help="preset name (`reconfig models list`) or checkpoint dir")
    parser.add_argument("--workers", type=int, default=workers, help="worker processes")
    parser.add_argument("--topology", default=topology, help="parallel layout, e.g. tp2pp2")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    from services.launch.up_config import add_gpu_arguments

    add_gpu_arguments(parser)
    parser.add_argument("--kv-cache-mb", type=int, default=64, help="KV cache budget per worker (MiB)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--verbose", action="store_true", help="show the services' structured logs")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reconfig", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="batch inference over sharded worker processes")
    _add_cluster_args(gen, workers=1, topology="tp1pp1")
    _add_sampling_args(gen)
    gen.add_argument("--prompts-file", required=True, type=Path,
                     help='JSONL: {"prompt_token_ids": [...]} or {"prompt": "..."} per line')
    gen.add_argument("--json", action="store_true", help='print {"outputs": [{"token_ids", "text"}]}')
    from services.launch import up_config

    up = commands.add_parser("up", help="start the whole stack (weightstore, workers, router, controller)")
    up_config.add_arguments(up)
    demo = commands.add_parser("demo", help="start the built-in model on 4 workers (TP2PP2) and generate")
    _add_cluster_args(demo, workers=4, topology="tp2pp2")
    _add_sampling_args(demo)
    from services.model import cli as models_cli

    models = commands.add_parser("models", help="list the preset models, or fetch and convert one (pull)")
    models_cli.add_arguments(models)
    from services.rpc import certs

    certs_parser = commands.add_parser("certs", help="write a development CA and a TLS certificate and key per host")
    certs.add_arguments(certs_parser)
    certs_parser.set_defaults(handler=certs.run)
    try:
        from services.simulator import cli as simulator_cli
    except ImportError:  # the simulator is optional at import time
        simulator_cli = None
    if simulator_cli is not None:
        sim = commands.add_parser("simulate", help="trace-driven multi-instance KV scheduling simulator")
        simulator_cli.add_arguments(sim)
        sim.set_defaults(handler=simulator_cli.run)
    return parser


def read_prompts(path: Path, tokenizer) -> list[list[int]]:
    """Parse a prompts JSONL file; raise ValueError naming the bad line."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from exc
        if isinstance(item, dict) and isinstance(item.get("prompt_token_ids"), list):
            ids = item["prompt_token_ids"]
            if not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ValueError(f"{path}:{number}: prompt_token_ids must be a non-empty list of ints >= 0")
            prompts.append(ids)
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompts.append(tokenizer.encode(item["prompt"]))
        else:
            raise ValueError(f'{path}:{number}: expected {{"prompt_token_ids": [...]}} or {{"prompt": "..."}}')
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def _run_generation(args: argparse.Namespace, prompts_text: list[str] | None) -> tuple[list, object, float]:
    from services.contracts.step import SamplingParams
    from services.launch.cluster import ClusterConfig, LocalCluster
    from services.launch.generate import generate
    from services.model.converted import ConsoleProgress
    from services.model.presets import resolve_model
    from services.model.tokenizer import Tokenizer
    from services.router.driver import Driver
    from services.topology import parse_gpus

    model_dir = resolve_model(args.model, progress=ConsoleProgress())
    tokenizer = Tokenizer.from_dir(model_dir)
    if prompts_text is None:
        prompts = read_prompts(args.prompts_file, tokenizer)
    else:
        prompts = [tokenizer.encode(p) for p in prompts_text]
    for i, prompt in enumerate(prompts):
        if max(prompt) >= _vocab_size(model_dir):
            raise ValueError(f"prompt {i}: token id {max(prompt)} outside the vocabulary")
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    stop = frozenset() if args.ignore_eos else tokenizer.eos_token_ids
    config = ClusterConfig(model=str(model_dir), num_workers=args.workers, topology=args.topology,
                           device=args.device, kv_cache_bytes=args.kv_cache_mb << 20, block_size=args.block_size,
                           gpus=parse_gpus(args.gpus), gpu_sharing=bool(args.gpu_sharing),
                           enforce_eager=bool(args.enforce_eager), dtype=args.dtype or "auto",
                           numerics=args.numerics or "fast", kernels=args.kernels or "torch")

    async def run() -> list:
        async with Driver(cluster.worker_addresses) as driver:
            return await generate(driver, prompts, args.max_tokens, sampling, stop)

    with LocalCluster(config) as cluster:
        started = time.perf_counter()
        results = asyncio.run(run())
        elapsed = time.perf_counter() - started
    return results, tokenizer, elapsed


def _vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def _generate_command(args: argparse.Namespace) -> int:
    results, tokenizer, _ = _run_generation(args, None)
    outputs = [{"token_ids": r.token_ids, "text": tokenizer.decode(r.token_ids)} for r in results]
    if args.json:
        print(json.dumps({"outputs": outputs}))
    else:
        for i, out in enumerate(outputs):
            print(f"[{i}] {out['text']!r}")
    return 0


def _demo_command(args: argparse.Namespace) -> int:
    print(f"reconfig demo: {args.model} on {args.workers} {args.device} workers in {args.topology}", flush=True)
    results, tokenizer, elapsed = _run_generation(args, DEMO_PROMPTS)
    for prompt, result in zip(DEMO_PROMPTS, results, strict=True):
        print(f"{prompt!r} -> {tokenizer.decode(result.token_ids)!r} ({len(result.token_ids)} tokens)")
    total = sum(len(r.token_ids) for r in results)
    print(f"{total} tokens in {elapsed:.2f}s ({total / elapsed:.1f} tokens/s)")
    return 0


def _up_command(args: argparse.Namespace) -> int:
    from services.launch.up import up
    from services.launch.up_config import UpConfig

    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config", "verbose", "handler")}
    return up(UpConfig.load(args.config, overrides))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from services.logs import configure_logging

    if not getattr(args, "verbose", False):
        os.environ.setdefault("RECONFIG_LOG_LEVEL", "WARNING")  # inherited by the service processes
    configure_logging("cli")
    handlers = {"generate": _generate_command, "demo": _demo_command, "up": _up_command}
    handler = handlers.get(args.command) or args.handler
    try:
        return handler(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"reconfig {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
