"""What crossing hosts costs (hosts as Linux namespaces, tests/multihost/hosts.py; needs root), side by side in one run:

1. the same tp2pp2 instance of 4 workers on one host and over two hosts (2 + 2), mutual TLS, 16 requests
   streaming through the switch chain tp2pp2 -> tp4pp1 -> tp1pp4 -> tp2pp2: each switch's downtime (its frozen
   phases) and the KV it moved (shared memory on one host, torch.distributed between two);
2. requests moved between two instances on two hosts, there and back: with their KV (over a gloo pair group per
   source worker) next to by re-prefill — bytes, time and downtime of each move.

    sudo python bench/multihost.py [--model tiny-llama] [--requests 16] [--max-tokens 160]

Prints a table, writes JSON and a plot (bench/results/ by default).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from report import apply_defaults, write_report  # noqa: E402

from services.model.presets import resolve_model  # noqa: E402
from services.rpc.auth import generate_token, write_token_file  # noqa: E402
from services.rpc.certs import write_dev_certs  # noqa: E402
from tests.multihost.hosts import NamespaceHosts, unavailable  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULTS = dict(model="tiny-llama", requests=16, max_tokens=160)
CHAIN = ["tp4pp1", "tp1pp4", "tp2pp2"]
FROZEN = ("QUIESCING", "PREPARING_WORKERS", "APPLYING_TOPOLOGY", "MIGRATING", "REBINDING")


def _tls(files) -> list[str]:
    return ["--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca)]


def _up(host, argv: list[str], env: dict, log: Path):
    return host.popen([sys.executable, "-m", "services.cli", "up", *argv], env=env, cwd=ROOT, stdout=log.open("w"),
                      stderr=subprocess.STDOUT)


def _wait_stack(process, run_dir: Path, name: str) -> None:
    from tests.conftest import wait_for_stack_file

    wait_for_stack_file(process, run_dir, name=name)


def _drive(host, spec: dict, env: dict, work: Path) -> dict:
    out = work / f"driven-{os.urandom(4).hex()}.json"
    ran = host.run([sys.executable, "-m", "tests.multihost.driver", str(out)], input=json.dumps(spec),
                   capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    if ran.returncode != 0:
        raise RuntimeError(ran.stderr[-3000:])
    return json.loads(out.read_text())


def _requests(count: int, max_tokens: int, seed: int):
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(4, 24))] for _ in range(count)], \
        [max_tokens] * count


def _switches(args, hosts, certs, token_file: Path, work: Path, two_hosts: bool) -> list[dict]:
    """The switch chain on one instance; each switch's downtime and KV moved."""
    env = {**os.environ, "RECONFIG_RUN_DIR": str(work / ("run2" if two_hosts else "run1"))}
    common = ["--model", args.model, "--topology", "tp2pp2", "--kv-cache-mb", "8", "--api-servers", "0",
              "--token-file", str(token_file), "--name", "bench"]
    if two_hosts:
        stacks = [_up(hosts[i], [*common, "--workers", "2", "--nodes", "2", "--node-rank", str(i),
                                 "--dist-addr", f"{hosts[0].address}:29600", "--host", hosts[i].address,
                                 *_tls(certs[i])], env, work / f"switch-{i}.log") for i in range(2)]
    else:
        stacks = [_up(hosts[0], [*common, "--workers", "4", "--host", hosts[0].address, *_tls(certs[0])], env,
                      work / "switch-one.log")]
    try:
        _wait_stack(stacks[0], Path(env["RECONFIG_RUN_DIR"]), "bench")
        prompts, lengths = _requests(args.requests, args.max_tokens, seed=1)
        spec = {"router": f"{hosts[0].address}:50052", "controller": f"{hosts[0].address}:50051",
                "token": token_file.read_text().strip(), "tls": _tls_spec(certs[0]),
                "phases": [{"name": "switches", "prompts": prompts, "max_tokens": lengths,
                            "actions": [{"reconfigure": t} for t in CHAIN]}]}
        actions = _drive(hosts[0], spec, env, work)["phases"][0]["actions"]
    finally:
        for stack in stacks:
            stack.terminate()
        for stack in stacks:
            stack.wait(60)
    rows = []
    for action in actions:
        operation = action["operation"]
        phases = operation.get("phase_seconds", {})
        rows.append({"switch": f"{operation['from_topology']}->{operation['to_topology']}",
                     "state": operation["state"], "in_flight": action["in_flight"],
                     "downtime_ms": 1000 * sum(phases.get(p, 0.0) for p in FROZEN),
                     "kv_bytes": int(operation.get("kv_bytes_moved", 0))})
    return rows


def _tls_spec(files) -> dict:
    return {"cert": str(files.cert), "key": str(files.key), "ca": str(files.ca)}


def _moves(args, hosts, certs, token_file: Path, work: Path) -> dict[str, list[dict]]:
    """Moves between an instance on each host, with their KV and by re-prefill."""
    envs = [{**os.environ, "RECONFIG_RUN_DIR": str(work / f"run-{name}")} for name in "ab"]
    stacks = [_up(hosts[i], ["--model", args.model, "--workers", "2", "--topology", "tp2pp1", "--kv-cache-mb", "8",
                             "--api-servers", "0", "--host", hosts[i].address, "--token-file", str(token_file),
                             "--name", name, *_tls(certs[i])], envs[i], work / f"move-{name}.log")
              for i, name in enumerate("ab")]
    try:
        for name, stack, env in zip("ab", stacks, envs):
            _wait_stack(stack, Path(env["RECONFIG_RUN_DIR"]), name)
        prompts, lengths = _requests(args.requests // 2 or 1, args.max_tokens, seed=2)
        spec = {"instances": [f"{h.address}:50052" for h in hosts.hosts], "model_dir": str(resolve_model(args.model)),
                "token": token_file.read_text().strip(), "tls": _tls_spec(certs[0]), "prompts": prompts,
                "max_tokens": lengths, "hops": [args.max_tokens // 4, args.max_tokens // 2]}
        return {mode: [m for output in _drive(hosts[0], {**spec, "reprefill": mode == "reprefill"}, envs[0],
                                              work)["outputs"] for m in output["moves"]]
                for mode in ("kv", "reprefill")}
    finally:
        for stack in stacks:
            stack.terminate()
        for stack in stacks:
            stack.wait(60)


def _plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    switches = [r for r in rows if r["kind"] == "switch"]
    moves = [r for r in rows if r["kind"] == "move"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    _paired(left, switches, ("one_host", "one host (shm)"), ("two_hosts", "two hosts (torch.distributed)"),
            "switch downtime (ms)")
    _paired(right, moves, ("kv", "with its KV"), ("reprefill", "by re-prefill"), "a move between hosts (ms)")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _paired(axes, rows: list[dict], first: tuple[str, str], second: tuple[str, str], ylabel: str) -> None:
    """Two bars per row (first and second: (key, label)), one tick per row's case."""
    xs = range(len(rows))
    for offset, (key, label) in ((-0.2, first), (0.2, second)):
        axes.bar([x + offset for x in xs], [r[key] for r in rows], 0.4, label=label)
    axes.set_xticks(list(xs), [r["case"] for r in rows])
    axes.set_ylabel(ylabel)
    axes.legend()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model")
    parser.add_argument("--requests", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "multihost.json")
    args = parser.parse_args()
    apply_defaults(args, DEFAULTS)
    if why := unavailable():
        print(f"bench/multihost.py: {why}", file=sys.stderr)
        return 2
    resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="reconfig-multihost-") as scratch, NamespaceHosts(2) as hosts:
        work = Path(scratch)
        certs = write_dev_certs([h.address for h in hosts.hosts], work / "certs")
        token_file = work / "token"
        write_token_file(token_file, generate_token())
        one = _switches(args, hosts, certs, token_file, work, two_hosts=False)
        two = _switches(args, hosts, certs, token_file, work, two_hosts=True)
        moved = _moves(args, hosts, certs, token_file, work)
    rows = [{"kind": "switch", "case": a["switch"], "one_host": a["downtime_ms"], "two_hosts": b["downtime_ms"],
             "kv_bytes_one_host": a["kv_bytes"], "kv_bytes_two_hosts": b["kv_bytes"],
             "ok": a["state"] == b["state"] == "OPERATION_STATE_SUCCEEDED"} for a, b in zip(one, two)]
    for metric, key in (("move time", "seconds"), ("move downtime", "downtime_s")):
        rows.append({"kind": "move", "case": metric,
                     **{mode: 1000 * statistics.mean(m[key] for m in moved[mode]) for mode in moved}})
    kv_bytes = statistics.mean(m["kv_bytes_precopied"] + m["kv_bytes_delta"] for m in moved["kv"])
    lines = ["| switch (16 streams) | downtime, one host | downtime, two hosts | ratio | KV moved, one / two hosts |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['one_host']:.1f} ms | {r['two_hosts']:.1f} ms | "
              f"{r['two_hosts'] / max(r['one_host'], 1e-9):.2f}x | {r['kv_bytes_one_host'] / 1024:.0f} / "
              f"{r['kv_bytes_two_hosts'] / 1024:.0f} KiB |" for r in rows if r["kind"] == "switch"]
    lines += ["", "| a move between hosts (mean) | with its KV | by re-prefill | ratio |", "|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['kv']:.1f} ms | {r['reprefill']:.1f} ms | "
              f"{r['kv'] / max(r['reprefill'], 1e-9):.2f}x |" for r in rows if r["kind"] == "move"]
    lines.append(f"\nKV carried per move: {kv_bytes / 1024:.0f} KiB (re-prefill: 0); {len(moved['kv'])} moves each "
                 "way (their tokens are checked against transformers in tests/multihost). One host pre-copies the KV "
                 "while serving, so its freeze moves only the delta; between hosts all of it moves in the freeze.")
    write_report(args, f"Crossing hosts ({args.model}, namespace hosts, mutual TLS)", "\n".join(lines), rows, _plot,
                 moves=moved, kv_bytes_per_move=kv_bytes)
    return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
