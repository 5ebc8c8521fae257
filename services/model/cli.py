"""`reconfig models list|pull`: the presets, their state in the cache, and fetching/converting one explicitly."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from services.model.converted import ConsoleProgress
from services.model.presets import preset_names, preset_statuses, resolve_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="models_command", required=True)
    listing = actions.add_parser("list", help="presets: kind, parameters, state (ready / not pulled / generated), path")
    listing.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    pull = actions.add_parser("pull", help="fetch and convert a preset now (`reconfig up` does it when needed)")
    pull.add_argument("name", choices=preset_names())
    parser.set_defaults(handler=run)


def _disk_size(path: Path) -> str:
    if not path.is_dir():
        return "-"
    size = sum(file.stat().st_size for file in path.iterdir() if file.is_file())
    return f"{size / (1 << 20):.0f} MiB"


def run(args: argparse.Namespace) -> int:
    if args.models_command == "pull":
        print(resolve_model(args.name, progress=ConsoleProgress()))
        return 0
    statuses = preset_statuses()
    if args.json:
        print(json.dumps([{"name": s.name, "kind": s.kind, "num_parameters": s.num_parameters, "state": s.state,
                           "path": str(s.path), "description": s.description} for s in statuses]))
        return 0
    rows = [("NAME", "KIND", "PARAMS", "DISK", "STATE", "PATH")]
    rows += [(s.name, s.kind, f"{s.num_parameters / 1e6:.1f}M", _disk_size(s.path), s.state, str(s.path))
             for s in statuses]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    return 0
