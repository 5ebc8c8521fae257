"""Structured logging (structlog) shared by every service: JSON lines on stderr, or readable lines on a terminal."""

from __future__ import annotations

import logging
import os
import sys

import structlog


class _CurrentStderr:
    """`sys.stderr` as it is when a line is written, not when logging was configured: loggers are cached on first
    use, and a process that replaces its stderr later (a test's capture, an embedding application) must not keep
    writing to the old, possibly closed, stream."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def console_line(logger: object, method_name: str, event_dict: dict) -> str:
    """One log line for a person at a terminal: `12:04:05 warning router: engine.drain_timeout  unfinished=1`."""
    fields = dict(event_dict)
    time_of_day = str(fields.pop("timestamp", ""))
    level = str(fields.pop("level", method_name))
    service = fields.pop("service", "")
    fields.pop("pid", None)
    event = fields.pop("event", "")
    trace = fields.pop("exception", "")
    extra = "  ".join(f"{key}={value}" for key, value in fields.items())
    line = f"{time_of_day} {level:<7} {service}: {event}" + (f"  {extra}" if extra else "")
    return f"{line}\n{trace}" if trace else line


def configure_logging(service: str, level: str | None = None) -> None:
    """Configure structlog once per process; `service` is bound to every line. A terminal gets one readable line per
    event (console_line); anything else (a file, a pipe, a log collector) JSON lines."""
    level_name = (level or os.environ.get("RECONFIG_LOG_LEVEL", "INFO")).upper()
    on_terminal = sys.stderr.isatty()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False) if on_terminal
            else structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            console_line if on_terminal else structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service, pid=os.getpid())
