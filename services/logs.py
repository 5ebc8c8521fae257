"""Structured logging (structlog) shared by every service: JSON lines on stderr, or console when a TTY."""

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


def configure_logging(service: str, level: str | None = None) -> None:
    """Configure structlog once per process; `service` is bound to every line."""
    level_name = (level or os.environ.get("RECONFIG_LOG_LEVEL", "INFO")).upper()
    renderer = (
        structlog.dev.ConsoleRenderer(colors=False)
        if sys.stderr.isatty()
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service, pid=os.getpid())
