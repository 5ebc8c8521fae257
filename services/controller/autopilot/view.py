"""The autopilot at the edge: its status as the wire message, and as the tables `reconfigctl autopilot status` and
`reconfigctl calibrate` print."""

from __future__ import annotations

import math
import time

from services.controller.autopilot.profile import LayoutModel, Profile
from services.rpc.reconfig.v1 import controller_pb2

BANDS_MAX_LOAD = 256


def status_pb(autopilot) -> controller_pb2.AutopilotStatus:
    """The autopilot's state now."""
    pb = controller_pb2.AutopilotStatus(mode=autopilot.mode, live_topology=str(autopilot.live),
                                        num_switches=autopilot.num_switches, error=autopilot.error,
                                        calibrating=autopilot.calibrating, profile_path=autopilot.config.profile_path)
    profile: Profile | None = autopilot.profile
    last = autopilot.last
    if profile is not None:
        pb.profile_machine, pb.profile_created_unix = profile.machine, profile.created_unix_s
        for m in profile.layouts.values():
            pb.layouts.add(layout=m.layout, step_seconds=m.step_s, per_request_seconds=m.per_request_s,
                           per_position_seconds=m.per_position_s, prefill_base_seconds=m.prefill_base_s,
                           prefill_per_token_seconds=m.prefill_per_token_s, kv_blocks=m.kv_blocks,
                           block_size=m.block_size, num_workers=m.num_workers, kv_pools=m.kv_pools,
                           balanced_layers=profile.layer_partition(m.layout) or ())
        pb.worker_layer_seconds.update({w.rank: w.layer_s for w in profile.worker_speeds})
        pb.head_layers = max((w.head_ratio for w in profile.worker_speeds), default=0.0)
        for s in profile.switches.values():
            pb.switches.add(from_topology=s.source, to_topology=s.target, downtime_seconds=s.downtime_s,
                            staging_seconds=s.staging_s)
        context = last.observation.context if last is not None and last.observation.context > 0 else \
            _sampled_context(profile)
        pb.bands_context_tokens = context
        for band in profile.bands(context, BANDS_MAX_LOAD):
            pb.bands.add(low=band.low, high=band.high, layout=band.layout)
    if last is not None:
        obs, decision = last.observation, last.decision
        pb.action, pb.target, pb.reason, pb.decided_at_unix = (decision.action, decision.target, decision.reason,
                                                              last.at_unix_s)
        pb.predicted_tpot_seconds.update(decision.predicted_tpot_s)
        pb.thresholds.update({k: v for k, v in decision.thresholds.items() if math.isfinite(v)})
        pb.load, pb.kv_blocks_used, pb.context_tokens = obs.load, obs.kv_used_blocks, obs.context
        pb.arrival_rate, pb.ttft_p99_seconds, pb.tpot_mean_seconds = obs.arrival_rate, obs.ttft_p99_s, obs.tpot_mean_s
        pb.has_forecast = obs.forecast_load is not None
        pb.forecast_load = obs.forecast_load or 0.0
        pb.intent_window = last.intent_window
        pb.allowed.extend(last.allowed or ())
        pb.rejected.update(last.rejected)
        pb.last_operation_id, pb.last_outcome = last.operation_id, last.outcome
    if autopilot.state is not None:
        pb.learned_corrections.update(dict(autopilot.state.corrections))
    return pb


def _sampled_context(profile: Profile) -> float:
    contexts = sorted({s.context for s in profile.decode_samples})
    return contexts[len(contexts) // 2] if contexts else 256.0


def layout_model(pb: controller_pb2.LayoutProfile) -> LayoutModel:
    """A layout's fitted costs back from the wire (what the CLI plots)."""
    return LayoutModel(pb.layout, pb.step_seconds, pb.per_request_seconds, pb.per_position_seconds,
                       pb.prefill_base_seconds, pb.prefill_per_token_seconds, pb.kv_blocks, pb.block_size,
                       pb.num_workers, max(pb.kv_pools, 1))


def format_profile(pb: controller_pb2.AutopilotStatus) -> str:
    """The profile as a table, the measured switches, and the bands (where each layout is best)."""
    if not pb.layouts:
        return "profile: none (run `reconfigctl calibrate`)"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(pb.profile_created_unix)) if pb.profile_created_unix else "?"
    lines = [f"profile: {len(pb.layouts)} layouts, measured {when} on {pb.profile_machine}",
             f"  {'layout':<10} {'step ms':>8} {'ms/req':>8} {'us/req/tok':>10} {'prefill ms/tok':>14} "
             f"{'KV blocks':>9} {'workers':>7}"]
    for m in sorted(pb.layouts, key=lambda m: m.layout):
        lines.append(f"  {m.layout:<10} {m.step_seconds * 1e3:8.2f} {m.per_request_seconds * 1e3:8.3f} "
                     f"{m.per_position_seconds * 1e6:10.4f} {m.prefill_per_token_seconds * 1e3:14.4f} "
                     f"{m.kv_blocks * max(m.kv_pools, 1):9d} {m.num_workers:7d}")
    for s in sorted(pb.switches, key=lambda s: (s.from_topology, s.to_topology)):
        lines.append(f"  switch {s.from_topology} -> {s.to_topology}: freeze {s.downtime_seconds * 1e3:.0f} ms, "
                     f"staging {s.staging_seconds:.1f} s")
    if pb.worker_layer_seconds:
        speeds = ", ".join(f"rank {r} {s * 1e3:.2f} ms" for r, s in sorted(pb.worker_layer_seconds.items()))
        lines.append(f"  per layer and step: {speeds}; a last stage's head costs {pb.head_layers:.1f} layers")
    for m in sorted(pb.layouts, key=lambda m: m.layout):
        if m.balanced_layers:
            lines.append(f"  {m.layout}: layers split {'/'.join(map(str, m.balanced_layers))} by measured speed")
    bands = ", ".join(f"{b.layout} for {b.low:.0f}-{b.high - 1:.0f}" for b in pb.bands)
    lines.append(f"  best layout by requests in flight (context {pb.bands_context_tokens:.0f} tokens): {bands}")
    return "\n".join(lines)


def format_status(pb: controller_pb2.AutopilotStatus) -> str:
    lines = [f"autopilot: {pb.mode}   live layout: {pb.live_topology}   switches made: {pb.num_switches}"]
    if pb.calibrating:
        lines.append(f"calibrating: {pb.calibrating}")
    if pb.error:
        lines.append(f"cannot decide: {pb.error}")
    if pb.action:
        verb = "keep" if pb.action == "keep" else f"switch to {pb.target}"
        would = "" if pb.mode == "auto" or pb.action == "keep" else " (advise: not switching)"
        lines.append(f"decision: {verb}{would}: {pb.reason}")
        forecast = f", forecast {pb.forecast_load:.1f} in flight" if pb.has_forecast else ""
        lines.append(f"saw: {pb.load} requests in flight, {pb.kv_blocks_used} KV blocks, context "
                     f"{pb.context_tokens:.0f} tokens, {pb.arrival_rate:.2f} req/s, p99 TTFT "
                     f"{pb.ttft_p99_seconds * 1e3:.0f} ms, TPOT {pb.tpot_mean_seconds * 1e3:.1f} ms{forecast}")
        if pb.predicted_tpot_seconds:
            lines.append("predicted TPOT: " + ", ".join(
                f"{k} {v * 1e3:.1f} ms" for k, v in sorted(pb.predicted_tpot_seconds.items())))
        if pb.learned_corrections:
            lines.append("learned while serving (measured / profiled TPOT): " + ", ".join(
                f"{k} x{v:.2f}" for k, v in sorted(pb.learned_corrections.items())))
        if pb.thresholds:
            lines.append("thresholds (requests in flight): " + ", ".join(
                f"{k} at {v:.1f}" for k, v in sorted(pb.thresholds.items())))
        if pb.intent_window or pb.allowed:
            lines.append(f"intent window {pb.intent_window or '-'}: allows {', '.join(pb.allowed) or 'none'}")
            for layout, why in sorted(pb.rejected.items()):
                lines.append(f"  {layout}: {why}")
        if pb.last_operation_id:
            lines.append(f"last switch {pb.last_operation_id}: {pb.last_outcome}")
    lines.append(format_profile(pb))
    return "\n".join(lines)


def plot_profile(pb: controller_pb2.AutopilotStatus, path: str, max_load: int = 64) -> None:
    """Predicted TPOT by requests in flight for each profiled layout (where its KV holds them), at the bands'
    context, with the band where each is best shaded. Needs matplotlib (ImportError otherwise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    context = pb.bands_context_tokens or 256.0
    figure, axis = plt.subplots(figsize=(7, 4.5))
    colors = {}
    for m in sorted((layout_model(m) for m in pb.layouts), key=lambda m: m.layout):
        loads = [n for n in range(1, max_load + 1) if n <= m.max_requests(context)]
        (line,) = axis.plot(loads, [m.tpot(n, context) * 1e3 for n in loads], label=m.layout)
        colors[m.layout] = line.get_color()
    for band in pb.bands:
        if band.low <= max_load:
            axis.axvspan(band.low - 0.5, min(band.high, max_load + 1) - 0.5, color=colors.get(band.layout, "grey"),
                         alpha=0.08)
    axis.set_xlabel("requests in flight")
    axis.set_ylabel("predicted TPOT (ms)")
    axis.set_title(f"layout profile ({pb.profile_machine}), context {context:.0f} tokens; shaded: best layout")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
