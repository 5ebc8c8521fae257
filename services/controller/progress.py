"""How a Reconfigure operation reads to an operator: its phases live (`reconfigctl reconfigure --wait`) and after
the fact (`reconfigctl status`), with the downtime, the bytes moved and the requests preempted."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TextIO

from services.contracts.phases import PHASES, SERVING_PHASES
from services.controller.status import OperationState, OperationStatus

BAR_WIDTH = 20
_SPINNER = "|/-\\"
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(num_bytes: int) -> str:
    """1536 -> '1.5 KiB' (binary units; whole bytes below 1 KiB)."""
    value, unit = float(num_bytes), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{num_bytes} B" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"


def ordered_phases(phase_seconds: Mapping[str, float]) -> list[tuple[str, float]]:
    """Phases in transaction order (a protobuf map does not keep it); unknown names last, by name."""
    rank = {phase: i for i, phase in enumerate(PHASES)}
    return sorted(phase_seconds.items(), key=lambda item: (rank.get(item[0], len(PHASES)), item[0]))


def _bar(fraction: float) -> str:
    filled = round(max(0.0, min(1.0, fraction)) * BAR_WIDTH)
    return "[" + "#" * filled + " " * (BAR_WIDTH - filled) + "]"


def totals_line(op: OperationStatus) -> str:
    """Downtime and what the operation moved."""
    staged = f"staged {op.staging_seconds:.3f} s while serving; " if op.staging_seconds else ""
    precopied = (f"KV pre-copied {format_bytes(op.kv_bytes_precopied)} ({op.precopy}) while serving; "
                 if op.kv_bytes_precopied else "")
    moved = "KV delta moved" if op.kv_bytes_precopied else "KV moved"
    return (f"{staged}{precopied}downtime {op.downtime_seconds:.3f} s; {moved} {format_bytes(op.kv_bytes_moved)}; "
            f"weights loaded {format_bytes(op.weight_bytes_loaded)}"
            + (f", resharded {format_bytes(op.weight_bytes_resharded)}" if op.weight_bytes_resharded else "") + "; "
            f"requests preempted {op.num_requests_preempted}")


def operation_lines(op: OperationStatus, indent: str = "  ") -> list[str]:
    """One line per finished phase (seconds, share of the downtime as a bar), then the totals; none for an
    operation that had nothing to do."""
    phases = ordered_phases(op.phase_seconds)
    if not phases and not op.kv_bytes_moved and not op.weight_bytes_loaded:
        return []
    downtime = op.downtime_seconds
    width = max((len(phase) for phase, _ in phases), default=0)
    lines = [f"{indent}{phase.ljust(width)}  {seconds:8.3f} s  "
             + ("while serving" if phase in SERVING_PHASES else
                f"{seconds / downtime if downtime else 0.0:4.0%}  {_bar(seconds / downtime if downtime else 0.0)}")
             for phase, seconds in phases]
    return lines + [indent + totals_line(op)]


def outcome_line(op: OperationStatus) -> str:
    """How the operation ended, in one line."""
    if op.state is OperationState.SUCCEEDED and not op.phase_seconds and op.kind == "reconfigure":
        return f"SUCCEEDED: {op.to_topology} is already live, nothing to do"
    line = f"{op.state.name}: {op.from_topology} -> {op.to_topology}"
    if op.state is OperationState.SUCCEEDED:
        return line + f" is live after {op.downtime_seconds:.3f} s of downtime"
    return line + (f"; error: {' '.join(op.error.split())}" if op.error else "")  # one line, even for an RPC error


class PhaseDisplay:
    """Draws one operation's phases as they happen. On a terminal the running phase is a line rewritten in place
    (carriage return) with a spinner and its seconds so far; elsewhere each phase prints one line once done."""

    def __init__(self, stream: TextIO, is_tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.is_tty = stream.isatty() if is_tty is None else is_tty
        self.clock = clock
        self.mark = "✓" if _can_encode(stream, "✓") else "+"
        self._started = False
        self._done: set[str] = set()
        self._running = ""            # the phase drawn as running (terminal only)
        self._running_since = 0.0     # local clock when it was first seen
        self._drawn_width = 0         # characters of the line being rewritten
        self._frame = 0

    def update(self, op: OperationStatus) -> None:
        """Draw what changed: the header once, every phase closed since the last update, the running phase."""
        if not self._started:
            self._started = True
            self._line(f"reconfigure {op.from_topology} -> {op.to_topology} (operation {op.operation_id})")
        phases = ordered_phases(op.phase_seconds)
        width = max(len(phase) for phase in PHASES)
        for phase, seconds in phases:
            if phase == "APPLYING_TOPOLOGY" and "MIGRATING" not in op.phase_seconds and op.phase:
                break  # both run in one worker RPC: the pair's split is known once MIGRATING has closed
            if phase not in self._done:
                self._done.add(phase)
                self._line(f"  {self.mark} {phase.ljust(width)}  {seconds:8.3f} s")
        running = op.phase if op.state is OperationState.RUNNING and op.phase not in self._done else ""
        if running and self.is_tty:
            if running != self._running:
                self._running, self._running_since = running, self.clock()
            self._frame += 1
            elapsed = self.clock() - self._running_since
            self._draw(f"  {_SPINNER[self._frame % len(_SPINNER)]} {running.ljust(width)}  {elapsed:8.1f} s  "
                       f"{self._bounce()}")

    def finish(self, op: OperationStatus) -> None:
        """Close the display with the operation as it ended: its last phases, the outcome and the totals."""
        self.update(op)
        self._draw("")
        self._line(outcome_line(op))
        if op.phase_seconds:
            self._line("  " + totals_line(op))

    def _bounce(self) -> str:
        """An indeterminate bar: a block that moves back and forth, one step per redraw."""
        span, size = BAR_WIDTH - 4, 4
        position = self._frame % (2 * span)
        position = position if position < span else 2 * span - position
        return "[" + " " * position + "=" * size + " " * (BAR_WIDTH - size - position) + "]"

    def _line(self, text: str) -> None:
        """A finished line (replacing the line being rewritten, if any)."""
        if self._drawn_width:
            text = "\r" + text.ljust(self._drawn_width)
            self._drawn_width = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def _draw(self, text: str) -> None:
        """Rewrite the running line in place (an empty text erases it)."""
        if not self.is_tty or (not text and not self._drawn_width):
            return
        self.stream.write("\r" + text.ljust(self._drawn_width) + ("" if text else "\r"))
        self.stream.flush()
        self._drawn_width = len(text)


def _can_encode(stream: TextIO, text: str) -> bool:
    try:
        text.encode(getattr(stream, "encoding", None) or "ascii")
    except (UnicodeEncodeError, LookupError):
        return False
    return True
