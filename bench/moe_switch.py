"""Moebius on CPU: live tp4 <-> ep4 switches of an MoE model, experts resharded by all-to-all vs re-read from the
weight store (in the freeze) vs staged beside the steps with the KV pre-copied, at low and high KV occupancy, next
to a cold restart; memcpy measured in the same run.

    python bench/moe_switch.py [--quick] [--out bench/results]

A Qwen3-MoE-style checkpoint made for the run (hidden 512, 4 sparse layers, 8/4 heads, 16 experts of 512,
top-2: 201 MB of experts in fp32, 50 MB per worker) is served by 4 workers in tp4pp1 through the router's
engine and the controller's transaction, in process. For each way of moving experts (`reshard`: one all-to-all per
sparse layer over the stage's group, gloo here; `store`: RECONFIG_EXPERT_RESHARD=off, every expert slice re-cut
from the shared-memory weight store; `staged`: the default strategy, the target's shards built from the store
while serving and the running requests' KV pre-copied into the target's pools, so the freeze copies the last blocks
only) and each occupancy, requests decode while the stack switches tp4 -> ep4 -> tp4; each switch's downtime,
phases, the workers' shard-build time and bytes are recorded. The cold restart is
stopping the stack, starting it again and re-prefilling the live requests' tokens. Prints a table; writes JSON and
a plot. Heavy imports stay inside functions: worker processes re-import this module as `__mp_main__`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
TOKEN = "bench-moe-switch"
MIB = 1 << 20
MODES = ("reshard", "store", "staged")


def log(message: str) -> None:
    print(f"[moe-switch {time.strftime('%H:%M:%S')}] {message}", flush=True)


def make_model(directory: Path):
    from services.model.moe_preset import MoePreset
    from services.model.presets import PresetSpec, _write_preset

    spec = PresetSpec(name="bench-moe", hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8,
                      num_kv_heads=4, vocab_size=320, max_position_embeddings=2048, rope_theta=10000.0, seed=3,
                      description="bench/moe_switch.py", moe=MoePreset(num_experts=16, num_experts_per_tok=2,
                                                                       moe_intermediate_size=512, mlp_only_layers=()))
    if not (directory / "config.json").exists():
        directory.mkdir(parents=True, exist_ok=True)
        _write_preset(spec, directory)
    experts = spec.num_layers * spec.moe.num_experts * 3 * spec.hidden_size * spec.moe.moe_intermediate_size * 4
    return directory, experts


def memcpy_gbps(num_bytes: int = 256 * MIB, repeats: int = 7) -> float:
    """One tensor copy, GB/s of bytes copied (median), with this process's threads."""
    import torch

    src = torch.rand(num_bytes // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return num_bytes / sorted(times)[len(times) // 2] / 1e9


async def start(model_dir: Path, mode: str):
    from services.controller.state import ControllerConfig, ControllerState
    from services.controller.transaction import Reconfigurer
    from services.launch.cluster import ClusterConfig, LocalCluster
    from services.model.expert_reshard import RESHARD_ENV
    from services.model.spec import ModelSpec
    from services.router.grpc_server import start_router_grpc
    from services.router.main import RouterConfig, build_engine

    from bench.switch import _RecordingWorker  # its stub wrapper that keeps each worker's ApplySwitch reply

    started = time.perf_counter()
    cluster = LocalCluster(ClusterConfig(model=str(model_dir), num_workers=4, topology="tp4pp1", kv_cache_bytes=64 * MIB,
                                         block_size=16, env={"RECONFIG_LOG_LEVEL": "WARNING",
                                                             RESHARD_ENV: "on" if mode == "reshard" else "off"}))
    cluster.start()
    addresses = tuple(cluster.worker_addresses)
    engine = await build_engine(RouterConfig(worker_addresses=addresses, model_dir=str(cluster.model_dir),
                                             model_name="bench-moe", max_num_seqs=256))
    server, port = await start_router_grpc(engine, "127.0.0.1", 0, TOKEN)
    state = ControllerState(ControllerConfig(token=TOKEN, worker_addresses=addresses, topology="tp4pp1",
                                             router_grpc_address=f"127.0.0.1:{port}", model_dir=str(cluster.model_dir)))
    await state.open()
    workers = [_RecordingWorker(stub) for stub in state.worker_stubs]
    reconfigurer = Reconfigurer(state, ModelSpec.from_dir(cluster.model_dir), workers, state.router_stub, TOKEN)
    return dict(cluster=cluster, engine=engine, server=server, state=state, workers=workers,
                reconfigurer=reconfigurer, start_seconds=time.perf_counter() - started)


async def stop(stack) -> float:
    started = time.perf_counter()
    await stack["engine"].stop()
    await stack["state"].close()
    await stack["server"].stop(0)
    stack["cluster"].stop()
    return time.perf_counter() - started


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(length)] for _ in range(count)]


async def run_mode(model_dir: Path, mode: str, occupancies: dict[str, tuple[int, int]], new_tokens: int) -> dict:
    from services.controller.status import OperationState
    from services.router.contracts import GenerationRequest

    stack = await start(model_dir, mode)
    engine, result = stack["engine"], {"start_seconds": stack["start_seconds"], "switches": []}

    async def consume(request, out: list[int]) -> None:
        async for delta in engine.generate(request):
            out.extend(delta.token_ids)

    try:
        for name, (count, length) in occupancies.items():
            outs = [[] for _ in range(count)]
            tasks = [asyncio.ensure_future(consume(GenerationRequest(f"{mode}-{name}-{i}", tuple(p), new_tokens),
                                                   outs[i]))
                     for i, p in enumerate(prompts(count, length, hash(name) % 1000))]
            while min(len(o) for o in outs) < 2:
                await asyncio.sleep(0.005)
            for target in ("ep4pp1", "tp4pp1"):
                stats = engine.stats()
                # reshard and store: in place (a staged switch builds its shards from the store, no all-to-all)
                strategy = "staged" if mode == "staged" else "in-place"
                operation = await stack["reconfigurer"].reconfigure(target, strategy=strategy)
                if operation.state is not OperationState.SUCCEEDED:
                    raise RuntimeError(f"{mode} -> {target}: {operation.state.name}: {operation.error}")
                replies = [w.applied for w in stack["workers"]]
                result["switches"].append(dict(
                    occupancy=name, target=target, live=sum(1 for t in tasks if not t.done()),
                    kv_blocks_used=stats.num_kv_blocks_used, kv_blocks_total=stats.num_kv_blocks_total,
                    downtime_s=operation.downtime_seconds, phases_s=dict(operation.phase_seconds),
                    kv_bytes_moved=operation.kv_bytes_moved, weight_bytes_loaded=operation.weight_bytes_loaded,
                    weight_bytes_resharded=operation.weight_bytes_resharded, precopy=operation.precopy,
                    kv_bytes_precopied=operation.kv_bytes_precopied,
                    build_s=max(r.reload_seconds for r in replies), migrate_s=max(r.migrate_seconds for r in replies),
                    resharded_per_worker=max(r.weight_bytes_resharded for r in replies),
                    kv_peak_extra=max(r.peak_extra_bytes for r in replies),
                    expert_peak_extra=max(r.expert_peak_extra_bytes for r in replies),
                    loaded_per_worker=max(r.weight_bytes_loaded for r in replies)))
                log(f"{mode} {name}: -> {target} downtime {operation.downtime_seconds * 1e3:.0f} ms, build "
                    f"{result['switches'][-1]['build_s'] * 1e3:.0f} ms, resharded "
                    f"{operation.weight_bytes_resharded / MIB:.0f} MiB, loaded {operation.weight_bytes_loaded / MIB:.0f} MiB")
            # The cold restart's re-prefill: every live request's tokens so far, prefilled again (1 new token).
            snapshot = [list(p) + o for p, o in zip(prompts(count, length, hash(name) % 1000), outs)]
            await asyncio.gather(*tasks)
            began = time.perf_counter()
            await asyncio.gather(*(consume(GenerationRequest(f"{mode}-{name}-re{i}", tuple(s), 1), [])
                                   for i, s in enumerate(snapshot)))
            result[f"reprefill_{name}_s"] = time.perf_counter() - began
    finally:
        result["stop_seconds"] = await stop(stack)
    return result


def table(result: dict) -> str:
    lines = ["| mode | occupancy | switch | live | KV used | downtime ms | MIGRATING ms | shard build ms | "
             "experts resharded MiB | weights loaded MiB | expert peak extra MiB | staging / pre-copy ms | "
             "KV pre-copied / in freeze MiB | restart ÷ switch |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        data = result.get(mode)
        if not data:
            continue
        for s in data["switches"]:
            restart = data["stop_seconds"] + data["start_seconds"] + data[f"reprefill_{s['occupancy']}_s"]
            lines.append(f"| {mode} | {s['occupancy']} | → {s['target']} | {s['live']} | {s['kv_blocks_used']}/"
                         f"{s['kv_blocks_total']} | {s['downtime_s'] * 1e3:.0f} | "
                         f"{s['phases_s'].get('MIGRATING', 0) * 1e3:.0f} | {s['build_s'] * 1e3:.0f} | "
                         f"{s['weight_bytes_resharded'] / MIB:.0f} | {s['weight_bytes_loaded'] / MIB:.0f} | "
                         f"{s.get('expert_peak_extra', 0) / MIB:.1f} | {s['phases_s'].get('STAGING', 0) * 1e3:.0f} / "
                         f"{s['phases_s'].get('PRECOPY', 0) * 1e3:.0f} | {s.get('kv_bytes_precopied', 0) / MIB:.1f} / "
                         f"{s['kv_bytes_moved'] / MIB:.1f} | {restart / s['downtime_s']:.1f}× |")
    out = "\n".join(lines)
    if "reshard" in result and "store" in result:
        pairs = list(zip(result["reshard"]["switches"], result["store"]["switches"]))
        ratios = [b["build_s"] / a["build_s"] for a, b in pairs]
        out += ("\n\nshard build, store ÷ reshard (same switch): "
                + ", ".join(f"{a['occupancy']} →{a['target']} {r:.2f}×" for (a, _), r in zip(pairs, ratios)))
        gbps = [a["resharded_per_worker"] / a["build_s"] / 1e9 for a, _ in pairs]
        out += (f"\nreshard GB/s per worker (expert bytes ÷ shard build): {', '.join(f'{g:.2f}' for g in gbps)}; "
                f"memcpy {result['memcpy_gbps']:.2f} GB/s; ratio {max(gbps) / result['memcpy_gbps']:.2f}")
    if "staged" in result:
        for other in ("reshard", "store"):
            if other in result:
                pairs = list(zip(result["staged"]["switches"], result[other]["switches"]))
                out += (f"\ndowntime, {other} in the freeze ÷ staged with the KV pre-copied (same switch): "
                        + ", ".join(f"{a['occupancy']} →{a['target']} {b['downtime_s'] / a['downtime_s']:.1f}× "
                                    f"({b['downtime_s'] * 1e3:.0f} / {a['downtime_s'] * 1e3:.0f} ms)"
                                    for a, b in pairs))
    # In place only: a staged switch holds the target's shard beside the live one (the staging budget decides).
    switches = [s for m in ("reshard", "store") if m in result for s in result[m]["switches"]]
    layer = result["experts_per_worker"] / result["num_sparse_layers"]
    experts_peak = max(s.get("expert_peak_extra", 0) for s in switches)
    kv_peak = max(s["kv_peak_extra"] for s in switches)
    # In reshard mode every weight loaded is a non-expert one (attention, norms), held beside the old until commit.
    dense = max(s["loaded_per_worker"] for s in result.get("reshard", {"switches": switches})["switches"])
    total = experts_peak + kv_peak + dense
    out += (f"\npeak extra memory per worker (in place: each sparse layer's old experts go as its new ones arrive): "
            f"experts {experts_peak / MIB:.1f} MiB (one layer's: {layer / MIB:.1f} MiB) + KV {kv_peak / MIB:.1f} MiB "
            f"+ non-expert weights loaded beside the old {dense / MIB:.1f} MiB = {total / MIB:.1f} MiB; target <= one "
            f"layer + 64 MiB = {(layer + 64 * MIB) / MIB:.1f} MiB: {'met' if total <= layer + 64 * MIB else 'missed'}")
    return out


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    modes = [m for m in MODES if m in result]
    labels = [f"{s['occupancy']} →{s['target']}" for s in result[modes[0]]["switches"]]
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        ax.bar([x + i * width for x in range(len(labels))],
               [s["downtime_s"] * 1e3 for s in result[mode]["switches"]], width, label=f"downtime ({mode})")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels)
    ax.set_ylabel("ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one occupancy, fewer tokens")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, in a child
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    occupancies = {"low": (4, 16)} if args.quick else {"low": (4, 16), "high": (48, 160)}
    new_tokens = 24 if args.quick else 64
    model_dir, expert_bytes = make_model(Path(os.environ.get("TMPDIR", "/tmp")) / "reconfig-bench-moe-switch")
    if args.mode:  # a child: one mode from a cold start (its own forkserver, imports, stacks)
        args.json.write_text(json.dumps(asyncio.run(run_mode(model_dir, args.mode, occupancies, new_tokens))))
        return
    result: dict = {"memcpy_gbps": memcpy_gbps(), "expert_bytes": expert_bytes, "experts_per_worker": expert_bytes / 4,
                    "num_sparse_layers": 4, "cores": len(os.sched_getaffinity(0))}
    log(f"memcpy {result['memcpy_gbps']:.2f} GB/s; experts {expert_bytes / MIB:.0f} MiB")
    import subprocess
    import tempfile

    for mode in MODES:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "mode.json"
            command = [sys.executable, __file__, "--mode", mode, "--json", str(out)] + (["--quick"] if args.quick else [])
            subprocess.run(command, check=True)
            result[mode] = json.loads(out.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (args.out / f"moe_switch-{stamp}.json").write_text(json.dumps(result, indent=2, default=str))
    plot(result, args.out / f"moe_switch-{stamp}.png")
    print("\n" + table(result) + "\n")


if __name__ == "__main__":
    main()
