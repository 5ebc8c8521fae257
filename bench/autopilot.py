"""The autopilot against every static layout: a compressed Azure conversation trace with a burst (quiet → burst →
quiet) replayed against a fresh `reconfig up` per layout and one in `auto` (issue 15).

    python bench/autopilot.py                     # smollm2-135m, 4 CPU workers, 5 static layouts + auto (~22 min)
    python bench/autopilot.py --quick             # short phases, tp1pp1 and tp1pp4 + auto (~5 min)
    python bench/autopilot.py --profile bench/results/autopilot-profile.json   # reuse a profile if present
    python bench/autopilot.py --profile ... --repeat 3   # every layout and auto 3 times, in rounds (~1 h)

What it measures: the same seeded request list (arrival gaps and lengths from the trace, each phase's gaps scaled
to its rate, prompts and outputs scaled and clipped, random prompt ids, ignore_eos) is streamed through the openai
client against each stack. Per run and per phase (of a request's arrival): SLO attainment (requests that completed
with TTFT ≤ the TTFT target and TPOT ≤ the TPOT target, of all that arrived; TTFT = first chunk with text, TPOT
= (e2e - TTFT) / (tokens - 1); a request past --request-timeout failed), p99 TTFT, mean TPOT, completed and
failed. For `auto` a 0.5 s poll of the controller's GetAutopilot records the live layout, the load and the
decisions, and the switches with their reasons. The SLO targets are derived from the layout profile (measured
first, once per bench run) before any run. Prints a table and PASS/MISS lines for issue 15's targets (auto meets or
beats the best static layout's attainment overall, and is within 10% of the best static layout in each phase);
writes a JSON and a plot under bench/results/. A bench: it never asserts.

`--repeat N` runs every static layout and auto N times, a round at a time (each round every layout once, so that
a slow spell of the machine hits all of them), and checks the targets on the mean attainment over the rounds,
with each layout's range and the rounds in which auto met the best static layout of that round: one layout's
attainment varied by more between single runs than the layouts differ.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import MAX_PROMPT_TOKEN_ID, MIN_OUTPUT_TOKENS, MIN_PROMPT_TOKEN_ID, TraceRequest, _send  # noqa: E402
from stack import REPO_ROOT, Stack  # noqa: E402  (stdlib only at import time)

DEFAULT_TRACE = REPO_ROOT / ".." / "shared" / "traces" / "azure_llm_2023_conv.csv"
RESULTS = REPO_ROOT / "bench" / "results"
ALL_LAYOUTS = "tp1pp1,tp1pp2,tp1pp3,tp1pp4,tp3pp1"  # smollm2-135m on 4 workers (9 heads / 3 KV heads: tp 1 or 3)
DEFAULT_POLICY = "cooldown_s=5,min_dwell_s=20,window=4,hysteresis=0.8,horizon_s=30"
AUTO = "auto"
POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    seconds: float
    rate: float                       # mean arrivals/s the trace's gaps are scaled to


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """The workload, the runs, the SLO and where the results go."""

    model: str
    trace: Path
    start: int                        # first trace row used
    phases: tuple[Phase, ...]
    prompt_scale: float               # prompt tokens = ContextTokens x prompt_scale, clipped to [1, max_prompt_tokens]
    output_scale: float               # max_tokens = GeneratedTokens x output_scale, clipped
    max_prompt_tokens: int
    max_output_tokens: int
    layouts: tuple[str, ...]          # static runs
    auto_start: str                   # the auto run's first layout
    policy: str                       # --autopilot-policy of the auto run
    profile: Path
    reuse_profile: bool               # the profile file exists and --profile asked for it
    calibrate_batches: tuple[int, ...]
    calibrate_prompts: tuple[int, ...]
    ttft_slo_s: float | None          # None: derived from the profile
    tpot_slo_s: float | None
    request_timeout: float            # seconds per request from its send; a request past it failed
    startup_timeout: float
    seed: int
    out: Path
    repeat: int = 1                   # rounds of every static layout and auto
    auto_intents: bool = True         # the auto run is told the SLO (an intents file with its targets)

    def __post_init__(self) -> None:
        if not self.phases or min(min(p.seconds, p.rate) for p in self.phases) <= 0:
            raise ValueError("every phase needs a positive duration and rate")
        if self.max_prompt_tokens < 1 or self.max_output_tokens < MIN_OUTPUT_TOKENS + 1:
            raise ValueError(f"need --max-prompt-tokens >= 1 and --max-output-tokens > {MIN_OUTPUT_TOKENS}")
        if not self.layouts:
            raise ValueError("need at least one static layout")
        if self.repeat < 1:
            raise ValueError("--repeat must be >= 1")


@dataclass(slots=True)
class RunResult:
    """One stack over the whole request list."""

    name: str
    requests: list = field(default_factory=list)       # serve.RequestResult, in request order
    wall_seconds: float = 0.0
    loadavg_before: tuple[float, ...] = ()
    loadavg_after: tuple[float, ...] = ()
    timeline: list[dict] = field(default_factory=list)  # auto: GetAutopilot polls
    switches: list[dict] = field(default_factory=list)  # auto: one per operation the autopilot started
    final_status: dict = field(default_factory=dict)    # auto: GetAutopilot at the end
    log_lines: list[str] = field(default_factory=list)  # auto: the controller's autopilot.* log lines


# ---- workload -----------------------------------------------------------------------------------------------------
def build_requests(config: BenchConfig, vocab_size: int) -> tuple[list[TraceRequest], list[str]]:
    """Consecutive trace rows from `start`: each phase takes the next rate x seconds rows and scales their gaps to
    span the phase (the trace's burstiness within it kept). Returns the requests and each one's phase."""
    from services.simulator.trace import load_trace

    trace = load_trace(config.trace)
    rng, high = random.Random(config.seed), min(MAX_PROMPT_TOKEN_ID, vocab_size - 1)
    requests, phases, row, phase_start = [], [], config.start, 0.0
    for phase in config.phases:
        count = max(1, round(phase.rate * phase.seconds))
        if row + count + 1 >= len(trace):
            raise SystemExit(f"{config.trace} has too few rows for the phases from row {config.start}")
        gaps = trace.arrival_s[row + 1:row + count + 2] - trace.arrival_s[row:row + count + 1]  # count + 1 gaps
        offsets = (gaps.cumsum()[:-1] * (phase.seconds / gaps.sum())).tolist()  # the last gap ends the phase
        for offset in offsets:
            row += 1
            context, generated = int(trace.prompt_tokens[row]), int(trace.output_tokens[row])
            num_prompt = min(max(round(context * config.prompt_scale), 1), config.max_prompt_tokens)
            max_tokens = min(max(round(generated * config.output_scale), MIN_OUTPUT_TOKENS), config.max_output_tokens)
            prompt = tuple(rng.randint(MIN_PROMPT_TOKEN_ID, high) for _ in range(num_prompt))
            requests.append(TraceRequest(len(requests), phase_start + offset, prompt, max_tokens, context, generated))
            phases.append(phase.name)
        phase_start += phase.seconds
    return requests, phases


# ---- profile and SLO ----------------------------------------------------------------------------------------------
def controller(stack: Stack):
    """A grpc.aio stub of the stack's controller and the call metadata."""
    import grpc

    from services.rpc.auth import auth_metadata
    from services.rpc.reconfig.v1 import controller_pb2_grpc

    token = Path(stack.info["token_file"]).read_text().strip()
    channel = grpc.aio.insecure_channel(stack.info["controller_address"])
    return channel, controller_pb2_grpc.ControllerStub(channel), auth_metadata(token)


async def _calibrate(stack: Stack, layouts: list[str], config: BenchConfig):
    from services.rpc.reconfig.v1 import controller_pb2

    channel, stub, auth = controller(stack)
    request = controller_pb2.CalibrateRequest(layouts=layouts, batch_sizes=config.calibrate_batches,
                                              prompt_tokens=config.calibrate_prompts)
    final = None
    async with channel:
        async for progress in stub.Calibrate(request, timeout=1800, metadata=auth):
            if progress.HasField("status"):
                final = progress.status
            else:
                print(f"    [{progress.done:4.0%}] {progress.message}", file=sys.stderr, flush=True)
    return final


def measure_profile(config: BenchConfig):
    """Start a stack (autopilot off, so the start does not calibrate every layout by itself) and calibrate the
    bench's layouts into `config.profile`; returns the Profile and the status message that carries it."""
    from services.controller.autopilot.profile import Profile

    layouts = list(dict.fromkeys((config.auto_start, *config.layouts)))
    print(f"profile: calibrating {', '.join(layouts)} into {config.profile}", file=sys.stderr, flush=True)
    args = ["--autopilot", "off", "--profile", str(config.profile)]
    with Stack(config.model, config.auto_start, startup_timeout=config.startup_timeout, extra_args=args) as stack:
        status = asyncio.run(_calibrate(stack, layouts, config))
    if status is None:
        raise SystemExit("the calibration ended without a profile")
    return Profile.load(config.profile), status


def profile_status(profile, path: Path):
    """The status message `format_profile` prints, for a profile read from a file (no stack needed)."""
    from services.controller.autopilot.view import status_pb

    pilot = SimpleNamespace(mode="off", live="-", num_switches=0, error="", calibrating="", last=None, state=None,
                            profile=profile, config=SimpleNamespace(profile_path=str(path)))
    return status_pb(pilot)


def derive_slo(config: BenchConfig, profile, requests: list[TraceRequest], phases: list[str]) -> dict:
    """TPOT target = 1.5x the best static layout's predicted TPOT at the burst (best: the lowest TPOT of those that
    keep up, else of all); TTFT target = 3x that layout's predicted prefill of the longest prompt, rounded up to
    0.5 s (at least 1 s). Flags override either."""
    burst = max(config.phases, key=lambda p: p.rate)
    inside = [r for r, p in zip(requests, phases) if p == burst.name] or requests
    prompt = sum(len(r.prompt) for r in inside) / len(inside)
    output = sum(r.max_tokens for r in inside) / len(inside)
    predictions = {name: profile.layouts[name].settle(burst.rate, prompt, output)
                   for name in config.layouts if name in profile.layouts}
    if not predictions or all(math.isinf(t) for _, t in predictions.values()):
        raise SystemExit("the profile predicts that every layout's prefills alone exceed the burst: lower it")
    best = min(predictions, key=lambda name: (math.isinf(predictions[name][0]), predictions[name][1]))
    longest = max(len(r.prompt) for r in requests)
    tpot_slo = 1.5 * predictions[best][1]
    ttft_slo = max(1.0, math.ceil(2 * 3 * profile.layouts[best].prefill(longest)) / 2)
    how = (f"burst {burst.rate:g} req/s, mean prompt {prompt:.0f} / output {output:.0f} tokens; predicted (in flight, "
           "TPOT ms): " + ", ".join(f"{n} ({'saturated' if math.isinf(load) else f'{load:.1f}'}, {t * 1e3:.0f})"
                                    for n, (load, t) in predictions.items())
           + f". Best: {best}. TPOT target = 1.5 x {predictions[best][1] * 1e3:.0f} ms; TTFT target = 3 x {best}'s "
           f"predicted prefill of the longest prompt ({longest} tokens, "
           f"{profile.layouts[best].prefill(longest):.2f} s), rounded up to 0.5 s.")
    return {"ttft_slo_s": config.ttft_slo_s or ttft_slo, "tpot_slo_s": config.tpot_slo_s or tpot_slo,
            "derived_ttft_slo_s": ttft_slo, "derived_tpot_slo_s": tpot_slo, "derivation": how, "best": best,
            "predictions": {n: {"load": load, "tpot_s": t} for n, (load, t) in predictions.items()},
            "overridden": [k for k in ("ttft_slo_s", "tpot_slo_s") if getattr(config, k) is not None]}


# ---- runs ---------------------------------------------------------------------------------------------------------
async def _poll_autopilot(stack: Stack, t0_box: list[float], result: RunResult, stop: asyncio.Event) -> None:
    """GetAutopilot every POLL_S: the live layout, the load and the decision; a switch event per operation."""
    from google.protobuf.json_format import MessageToDict

    from services.rpc.reconfig.v1 import controller_pb2

    channel, stub, auth = controller(stack)
    seen: set[str] = set()
    async with channel:
        while not stop.is_set():
            t = time.perf_counter() - t0_box[0]
            try:
                pb = await stub.GetAutopilot(controller_pb2.GetAutopilotRequest(), timeout=2, metadata=auth)
            except Exception as exc:  # noqa: BLE001 - a missed poll is recorded, never raised
                result.timeline.append({"t": t, "error": f"{type(exc).__name__}: {exc}"[:200]})
            else:
                result.timeline.append({"t": round(t, 3), "live": pb.live_topology, "load": pb.load,
                                        "forecast": round(pb.forecast_load, 2) if pb.has_forecast else None,
                                        "action": pb.action, "target": pb.target, "switches": pb.num_switches,
                                        **({"reason": pb.reason} if pb.action == "switch" else {})})
                if pb.last_operation_id and pb.last_operation_id not in seen:
                    seen.add(pb.last_operation_id)
                    result.switches.append({"t": round(t, 3), "operation_id": pb.last_operation_id,
                                            "target": pb.target, "reason": pb.reason, "outcome": pb.last_outcome,
                                            "load": pb.load})
                result.final_status = MessageToDict(pb, preserving_proto_field_name=True)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_S)


async def replay(stack: Stack, requests: list[TraceRequest], timeout: float, result: RunResult,
                 poll: bool) -> None:
    """Two untimed warm-up requests, then every request at its arrival time (concurrently)."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0,
                                  timeout=timeout) as client:
        model = (await client.models.list()).data[0].id
        for request in requests[:2]:
            await _send(client, model, TraceRequest(-1, 0.0, request.prompt, 4, 0, 0), time.perf_counter(), timeout)
        t0_box, stop = [time.perf_counter()], asyncio.Event()
        poller = asyncio.create_task(_poll_autopilot(stack, t0_box, result, stop)) if poll else None
        result.requests = list(await asyncio.gather(*(_send(client, model, r, t0_box[0], timeout) for r in requests)))
        result.wall_seconds = time.perf_counter() - t0_box[0]
        stop.set()
        if poller is not None:
            await poller


def write_intents(slo: dict, path: Path) -> Path:
    """The SLO as the operator would state it to the autopilot: one window all week with both targets."""
    window = {"name": "slo", "start": "00:00", "end": "24:00", "p99_ttft_ms": round(slo["ttft_slo_s"] * 1e3, 3),
              "tpot_ms": round(slo["tpot_slo_s"] * 1e3, 3)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"windows": [window]}, indent=2) + "\n")
    return path


def run_stack(config: BenchConfig, name: str, requests: list[TraceRequest], intents: Path | None = None) -> RunResult:
    """A fresh stack for one static layout (autopilot off) or for auto (following `intents` when given); replay;
    stop it."""
    is_auto = name == AUTO
    args = (["--autopilot", "auto", "--profile", str(config.profile), "--autopilot-policy", config.policy,
             "--verbose", *(["--intents", str(intents)] if intents else [])] if is_auto else ["--autopilot", "off"])
    result = RunResult(name, loadavg_before=os.getloadavg())
    print(f"run {name}: starting", file=sys.stderr, flush=True)
    with Stack(config.model, config.auto_start if is_auto else name, startup_timeout=config.startup_timeout,
               extra_args=args) as stack:
        asyncio.run(replay(stack, requests, config.request_timeout, result, poll=is_auto))
        log = stack.log_tail(1 << 30)
        if is_auto:
            result.log_lines = [line for line in log.splitlines() if "autopilot." in line][-400:]
        if any(r.error and "Timeout" not in r.error for r in result.requests):
            print(f"  reconfig up log tail:\n{log[-3000:]}", file=sys.stderr)
    result.loadavg_after = os.getloadavg()
    done = sum(r.error is None for r in result.requests)
    print(f"run {name}: {done}/{len(requests)} completed in {result.wall_seconds:.0f} s, load average "
          f"{result.loadavg_after[0]:.2f}", file=sys.stderr, flush=True)
    return result


# ---- report -------------------------------------------------------------------------------------------------------
def tpot(r) -> float | None:
    """(e2e - TTFT) / (tokens - 1): TTFT is the first chunk with text."""
    if r.error or r.ttft is None or r.e2e is None or r.num_tokens < 2:
        return None
    return (r.e2e - r.ttft) / (r.num_tokens - 1)


def meets(r, slo: dict) -> bool:
    t = tpot(r)
    return r.error is None and r.ttft is not None and t is not None and r.ttft <= slo["ttft_slo_s"] \
        and t <= slo["tpot_slo_s"]


def summarize(result: RunResult, phases: list[str], slo: dict) -> dict[str, dict]:
    """Per phase (and "all"): requests, completed, failed, attainment %, p99 TTFT s, mean TPOT ms."""
    import numpy as np

    out = {}
    for phase in ("all", *dict.fromkeys(phases)):
        mine = [r for r, p in zip(result.requests, phases) if phase in ("all", p)]
        done = [r for r in mine if r.error is None]
        ttfts, tpots = [r.ttft for r in done if r.ttft is not None], [t for t in map(tpot, done) if t is not None]
        out[phase] = {"requests": len(mine), "completed": len(done), "failed": len(mine) - len(done),
                      "attainment_pct": 100.0 * sum(meets(r, slo) for r in mine) / len(mine) if mine else 0.0,
                      "ttft_p99_s": float(np.percentile(ttfts, 99)) if ttfts else None,
                      "tpot_mean_ms": 1e3 * float(np.mean(tpots)) if tpots else None,
                      "timeouts": sum(bool(r.error and "Timeout" in r.error) for r in mine)}
    return out


def layout_spans(result: RunResult, end: float) -> list[tuple[float, float, str]]:
    """(start, end, layout) of auto's live layout from the polls (start of the replay = 0)."""
    spans: list[tuple[float, float, str]] = []
    for sample in (s for s in result.timeline if "live" in s):
        if spans and spans[-1][2] == sample["live"]:
            continue
        if spans:
            spans[-1] = (spans[-1][0], sample["t"], spans[-1][2])
        spans.append((max(sample["t"], 0.0) if spans else 0.0, end, sample["live"]))
    return spans


def format_report(results: list[RunResult], summaries: dict, slo: dict, phases: list[str]) -> tuple[str, list[str]]:
    """The table, auto's timeline, and the target check lines."""
    def fmt(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    names = list(dict.fromkeys(phases))
    lines = ["| run | phase | requests | completed | failed (timeouts) | SLO attainment | TTFT p99 s | TPOT mean ms "
             "| switches |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for result in results:
        switches = str(len(result.switches)) if result.name == AUTO else "-"
        for phase in ("all", *names):
            s = summaries[result.name][phase]
            lines.append(f"| {result.name} | {phase} | {s['requests']} | {s['completed']} | {s['failed']} "
                         f"({s['timeouts']}) | {s['attainment_pct']:.1f}% | {fmt(s['ttft_p99_s'], '.2f')} | "
                         f"{fmt(s['tpot_mean_ms'], '.0f')} | {switches if phase == 'all' else ''} |")
    auto = next((r for r in results if r.name == AUTO), None)
    if auto is not None:
        spans = layout_spans(auto, auto.wall_seconds)
        lines += ["", "auto's live layout: " + ", ".join(f"{l} {a:.0f}-{b:.0f} s" for a, b, l in spans)]
        lines += [f"  switch at {s['t']:.1f} s -> {s['target']} ({s['outcome']}): {s['reason']}" for s in auto.switches]
    return "\n".join(lines), target_check(summaries, names)


def mean_summaries(per_round: list[dict[str, dict]]) -> dict[str, dict]:
    """Each run name's phases averaged over the rounds (attainment, p99 TTFT, mean TPOT), with the attainment's
    range."""
    out: dict[str, dict] = {}
    for name in per_round[0]:
        out[name] = {}
        for phase in per_round[0][name]:
            rows = [summaries[name][phase] for summaries in per_round]
            values = [r["attainment_pct"] for r in rows]

            def mean(key: str):
                known = [r[key] for r in rows if r[key] is not None]
                return sum(known) / len(known) if known else None

            out[name][phase] = {"requests": rows[0]["requests"], "attainment_pct": sum(values) / len(values),
                                "attainment_min_pct": min(values), "attainment_max_pct": max(values),
                                "ttft_p99_s": mean("ttft_p99_s"), "tpot_mean_ms": mean("tpot_mean_ms"),
                                "failed": sum(r["failed"] for r in rows), "rounds": len(rows)}
    return out


def repeat_report(means: dict[str, dict], per_round: list[dict[str, dict]], phases: list[str]
                  ) -> tuple[str, list[str]]:
    """The table of means over the rounds (attainment with its range), and the target checks on the means, with
    the rounds in which auto met each round's best static layout."""
    names = list(dict.fromkeys(phases))
    lines = [f"means over {len(per_round)} rounds", "",
             "| run | phase | SLO attainment mean (min-max) | TTFT p99 s (mean) | TPOT mean ms (mean) | failed |",
             "|---|---|---|---:|---:|---:|"]
    for name, by_phase in means.items():
        for phase in ("all", *names):
            s = by_phase[phase]
            ttft = "-" if s["ttft_p99_s"] is None else f"{s['ttft_p99_s']:.2f}"
            tpot_ms = "-" if s["tpot_mean_ms"] is None else f"{s['tpot_mean_ms']:.0f}"
            lines.append(f"| {name} | {phase} | {s['attainment_pct']:.1f}% ({s['attainment_min_pct']:.1f}-"
                         f"{s['attainment_max_pct']:.1f}) | {ttft} | {tpot_ms} | {s['failed']} |")
    checks = target_check(means, names)
    met = sum(summaries[AUTO]["all"]["attainment_pct"] >= max(
        s["all"]["attainment_pct"] for n, s in summaries.items() if n != AUTO) for summaries in per_round)
    checks.append(f"auto met or beat the round's best static layout overall in {met} of {len(per_round)} rounds")
    return "\n".join(lines), checks


def target_check(summaries: dict, phases: list[str]) -> list[str]:
    """Issue 15's targets as PASS/MISS lines (auto must have run)."""
    statics = [n for n in summaries if n != AUTO]
    if AUTO not in summaries or not statics:
        return ["targets: not checked (auto and at least one static layout must run)"]
    best = max(statics, key=lambda n: summaries[n]["all"]["attainment_pct"])
    mine, theirs = summaries[AUTO]["all"]["attainment_pct"], summaries[best]["all"]["attainment_pct"]
    lines = [f"{'PASS' if mine >= theirs else 'MISS'} overall: auto {mine:.1f}% vs the best static layout {best} "
             f"{theirs:.1f}% (auto must meet or beat it)"]
    for phase in phases:
        best = max(statics, key=lambda n: summaries[n][phase]["attainment_pct"])
        mine, theirs = summaries[AUTO][phase]["attainment_pct"], summaries[best][phase]["attainment_pct"]
        lines.append(f"{'PASS' if mine >= 0.9 * theirs else 'MISS'} {phase}: auto {mine:.1f}% vs the best static "
                     f"layout there, {best} {theirs:.1f}% (within 10%: >= {0.9 * theirs:.1f}%)")
    return lines


def plot(results: list[RunResult], summaries: dict, requests: list[TraceRequest], config: BenchConfig,
         path: Path) -> None:
    """Top: offered load and auto's requests in flight, auto's live layout as spans; bottom: attainment bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(13, 8.5), gridspec_kw={"height_ratios": [1.2, 1]})
    end = max(r.wall_seconds for r in results)
    auto = next((r for r in results if r.name == AUTO), None)
    if auto is not None:
        spans = layout_spans(auto, auto.wall_seconds)
        colors = dict(zip(sorted({layout for *_, layout in spans}), plt.cm.Pastel1.colors))
        for a, b, layout in spans:
            top.axvspan(a, b, color=colors[layout], alpha=0.6, lw=0)
        for layout, color in colors.items():
            top.plot([], [], color=color, lw=8, label=f"auto live: {layout}")
    grid = np.arange(0.0, end, 0.5)
    for result in results:
        starts = np.array([q.arrival + r.send_lag for q, r in zip(requests, result.requests)])
        ends = np.array([r.finished_at for r in result.requests])
        in_flight = [np.sum((starts <= t) & (ends > t)) for t in grid]
        style = {"color": "black", "lw": 1.8} if result.name == AUTO else {"lw": 0.9, "alpha": 0.8}
        top.plot(grid, in_flight, label=f"in flight: {result.name}", **style)
    bins = np.arange(0.0, end + 5.0, 5.0)
    counts, _ = np.histogram([r.arrival for r in requests], bins)
    rate_axis = top.twinx()
    rate_axis.step(bins, np.append(counts, counts[-1]) / 5.0, where="post", color="0.45", ls=":", lw=1.4)
    rate_axis.set_ylabel("arrivals/s (5 s bins, dotted)")
    rate_axis.set_ylim(0, max(counts.max() / 5.0 * 2.5, 1.0))
    edge = 0.0
    for phase in config.phases[:-1]:
        edge += phase.seconds
        top.axvline(edge, color="0.3", ls="--", lw=0.8)
    top.set_xlabel("seconds since the first arrival")
    top.set_ylabel("requests in flight (client side)")
    top.legend(fontsize=7, ncol=3, loc="upper right")
    top.grid(alpha=0.3)
    phase_names = ["all", *dict.fromkeys(p.name for p in config.phases)]
    width = 0.8 / len(results)
    for i, result in enumerate(results):
        values = [summaries[result.name][p]["attainment_pct"] for p in phase_names]
        bottom.bar(np.arange(len(phase_names)) + i * width, values, width,
                   label=result.name, **({"color": "black"} if result.name == AUTO else {}))
    bottom.set_xticks(np.arange(len(phase_names)) + width * (len(results) - 1) / 2, phase_names)
    bottom.set_ylabel("SLO attainment %")
    bottom.set_ylim(0, 105)
    bottom.legend(fontsize=8, ncol=len(results))
    bottom.grid(alpha=0.3, axis="y")
    figure.suptitle(f"{config.model}: autopilot vs static layouts, burst trace")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# ---- main ---------------------------------------------------------------------------------------------------------
def _tuple(text: str, kind=str) -> tuple:
    return tuple(kind(v.strip()) for v in text.split(",") if v.strip())


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: phases 15/30/15 s, tp1pp1 and tp1pp4, a smaller calibration (~5 min)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--start", type=int, default=0, help="first trace row")
    parser.add_argument("--quiet-s", type=float, help="each quiet phase's seconds [45; quick 15]")
    parser.add_argument("--burst-s", type=float, help="burst seconds [90; quick 30]")
    parser.add_argument("--quiet-rate", type=float, default=0.15, help="arrivals/s in the quiet phases")
    parser.add_argument("--burst-rate", type=float, default=1.2, help="arrivals/s in the burst")
    parser.add_argument("--prompt-scale", type=float, default=1 / 8, help="x ContextTokens")
    parser.add_argument("--output-scale", type=float, default=1 / 4, help="x GeneratedTokens")
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--max-output-tokens", type=int, default=48)
    parser.add_argument("--layouts", help=f"static layouts [{ALL_LAYOUTS}; quick tp1pp1,tp1pp4]")
    parser.add_argument("--auto-start", default="tp1pp4", help="the auto run's first layout")
    parser.add_argument("--autopilot-policy", default=DEFAULT_POLICY, help="of the auto run")
    parser.add_argument("--profile", type=Path,
                        help="reuse this profile if it exists, else calibrate into it [calibrate into "
                             "bench/results/autopilot-profile.json, quick: autopilot-quick-profile.json]")
    parser.add_argument("--calibrate-batches", default="1,4,12", help="requests kept in flight per calibration load [quick: 1,8]")
    parser.add_argument("--calibrate-prompts", default="32,160", help="prompt tokens of the calibration loads")
    parser.add_argument("--ttft-slo-s", type=float, help="default: derived from the profile (printed)")
    parser.add_argument("--tpot-slo-s", type=float, help="default: derived from the profile (printed)")
    parser.add_argument("--request-timeout", type=float, help="seconds per request from its send [60; quick 30]")
    parser.add_argument("--startup-timeout", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="[bench/results/autopilot.json; quick: autopilot-quick.json]")
    parser.add_argument("--no-auto-intents", dest="auto_intents", action="store_false",
                        help="do not tell the auto run the SLO (by default it follows an intents file with both "
                             "targets, as an operator would state them)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="rounds of every static layout and auto; the targets are checked on the means [1]")
    args = parser.parse_args(argv)
    quick = args.quick
    quiet_s, burst_s = args.quiet_s or (15.0 if quick else 45.0), args.burst_s or (30.0 if quick else 90.0)
    stem = "autopilot-quick" if quick else "autopilot"
    profile = args.profile or RESULTS / f"{stem}-profile.json"
    return BenchConfig(
        model=args.model, trace=args.trace.resolve(), start=args.start,
        phases=(Phase("quiet-1", quiet_s, args.quiet_rate), Phase("burst", burst_s, args.burst_rate),
                Phase("quiet-2", quiet_s, args.quiet_rate)),
        prompt_scale=args.prompt_scale, output_scale=args.output_scale, max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        layouts=_tuple(args.layouts or ("tp1pp1,tp1pp4" if quick else ALL_LAYOUTS)), auto_start=args.auto_start,
        policy=args.autopilot_policy, profile=profile.resolve(),
        reuse_profile=args.profile is not None and args.profile.is_file(),
        calibrate_batches=_tuple("1,8" if quick and args.calibrate_batches == "1,4,12" else args.calibrate_batches,
                                 int),
        calibrate_prompts=_tuple(args.calibrate_prompts, int), ttft_slo_s=args.ttft_slo_s, tpot_slo_s=args.tpot_slo_s,
        request_timeout=args.request_timeout or (30.0 if quick else 60.0), startup_timeout=args.startup_timeout,
        seed=args.seed, out=(args.out or RESULTS / f"{stem}.json").resolve(), repeat=args.repeat,
        auto_intents=args.auto_intents,
    )


def machine_info() -> dict:
    cpu = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "torch": metadata.version("torch"), "python": platform.python_version(), "platform": platform.platform()}


def main(argv: list[str] | None = None) -> None:
    from services.logs import configure_logging
    from services.model.presets import resolve_model
    from services.model.tokenizer import Tokenizer

    configure_logging("bench", "WARNING")
    config = parse_args(argv)
    started, loadavg_start = time.perf_counter(), os.getloadavg()
    requests, phases = build_requests(config, Tokenizer.from_dir(resolve_model(config.model)).vocab_size)
    counts = {p: phases.count(p) for p in dict.fromkeys(phases)}
    print(f"autopilot bench: {config.model}, {len(requests)} requests ({counts}), load average "
          f"{loadavg_start[0]:.2f}", file=sys.stderr, flush=True)
    if config.reuse_profile:
        from services.controller.autopilot.profile import Profile

        profile = Profile.load(config.profile)
        status = profile_status(profile, config.profile)
    else:
        profile, status = measure_profile(config)
    from services.controller.autopilot.view import format_profile

    print(format_profile(status))
    slo = derive_slo(config, profile, requests, phases)
    print(f"\nSLO: TTFT <= {slo['ttft_slo_s']:.2f} s, TPOT <= {slo['tpot_slo_s'] * 1e3:.0f} ms"
          f"{' (overridden: ' + ', '.join(slo['overridden']) + ')' if slo['overridden'] else ''}\n"
          f"  derived from the profile before any run: {slo['derivation']}\n", flush=True)
    intents = write_intents(slo, config.out.with_name(config.out.stem + "-intents.json")) \
        if config.auto_intents else None
    rounds = []
    for number in range(config.repeat):
        if config.repeat > 1:
            print(f"round {number + 1} of {config.repeat}", file=sys.stderr, flush=True)
        rounds.append([run_stack(config, name, requests, intents) for name in (*config.layouts, AUTO)])
    per_round = [{r.name: summarize(r, phases, slo) for r in results} for results in rounds]
    results, summaries = rounds[-1], per_round[-1]
    table, checks = format_report(results, summaries, slo, phases)
    if config.repeat > 1:
        summaries = mean_summaries(per_round)
        table, checks = repeat_report(summaries, per_round, phases)
    elapsed = time.perf_counter() - started
    print(table + "\n\n" + "\n".join(checks))
    write_results(config, requests, phases, profile, slo, results, summaries, table, checks, elapsed, loadavg_start,
                  per_round)


def write_results(config, requests, phases, profile, slo, results, summaries, table, checks, elapsed,
                  loadavg_start, per_round=()) -> None:
    """The JSON (the last round's runs in full; with --repeat, every round's summaries and the means) and the plot
    (the last round)."""
    payload = {
        "bench": "autopilot", "config": {**asdict(config), "trace": str(config.trace), "out": str(config.out),
                                         "profile": str(config.profile)},
        "machine": machine_info(), "wall_seconds": elapsed,
        "loadavg": {"start": loadavg_start, "end": os.getloadavg(),
                    "per_run": {r.name: {"before": r.loadavg_before, "after": r.loadavg_after} for r in results}},
        "profile": profile.to_json() | {"decode_samples": len(profile.decode_samples),
                                        "prefill_samples": len(profile.prefill_samples)},
        "slo": slo, "table": table, "targets": checks, "summaries": summaries, "rounds": list(per_round),
        "requests": [{"index": r.index, "arrival": r.arrival, "phase": p, "prompt_tokens": len(r.prompt),
                      "max_tokens": r.max_tokens} for r, p in zip(requests, phases)],
        "runs": [{"name": r.name, "wall_seconds": r.wall_seconds, "switches": r.switches, "timeline": r.timeline,
                  "final_status": r.final_status, "log_lines": r.log_lines,
                  "requests": [{"ttft": q.ttft, "tpot": tpot(q), "e2e": q.e2e, "num_tokens": q.num_tokens,
                                "send_lag": q.send_lag, "error": q.error, "meets_slo": meets(q, slo)}
                               for q in r.requests]} for r in results],
    }
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    plot_path = config.out.with_suffix(".png")
    plot(results, per_round[-1] if per_round else summaries, requests, config, plot_path)
    print(f"\nwrote {config.out} and {plot_path} in {elapsed:.0f} s (load average {os.getloadavg()[0]:.2f})",
          file=sys.stderr)


if __name__ == "__main__":
    main()
