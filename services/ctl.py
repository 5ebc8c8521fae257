"""`reconfigctl`: the operator's command line. The controller's commands (services.controller.cli) and the front
router's `instances` (services.front.cli) in one parser; it sits above both layers, so neither imports the other."""

from __future__ import annotations

import sys

from services.controller import cli as controller_cli
from services.front import cli as front_cli

FRONT_COMMANDS: dict[str, controller_cli.ExtraCommand] = {
    "instances": (front_cli.add_parser, front_cli.instances_command),
}


def build_parser():
    """Every command's flags."""
    return controller_cli.build_parser(tuple(FRONT_COMMANDS.values()))


def main(argv: list[str] | None = None) -> int:
    """Entry of the `reconfigctl` console script: 0 ok; 1 unreachable or failed; 2 usage, or a refused request."""
    return controller_cli.main(argv, FRONT_COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
