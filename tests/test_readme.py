"""The README is a quickstart that cannot drift: its ```console commands and ```python blocks run as written against
`reconfig up` with no flags, and every link in it (and in docs/) resolves inside the repository."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import wait_for_stack_file
from tests.up_stack import wait_ready

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 200
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def fenced(text: str, language: str) -> list[str]:
    """The bodies of the fenced blocks of `language`, in order."""
    return [body for kind, body in _FENCE.findall(text) if kind == language]


def console_commands(text: str) -> list[str]:
    """Every `$ ` line of the ```console blocks (with its ` \\` continuation lines), in order."""
    commands = []
    for block in fenced(text, "console"):
        lines = iter(block.splitlines())
        for line in lines:
            if not line.startswith("$ "):
                continue  # output shown for the reader
            command = line[2:]
            while command.endswith("\\"):
                command = command[:-1] + next(lines).strip()
            commands.append(command)
    return commands


def test_the_readme_is_short_and_its_commands_are_found():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    commands = console_commands(text)
    assert any(c.startswith("curl") for c in commands) and "reconfigctl status" in commands
    assert any(c.startswith("reconfigctl reconfigure") for c in commands)
    assert len(fenced(text, "python")) == 1


@pytest.mark.parametrize("document", [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"],
                         ids=lambda path: str(path.relative_to(ROOT)))
def test_every_link_resolves_inside_the_repository(document):
    for target in _LINK.findall(document.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address or an anchor of the page itself
        path = (document.parent / target.partition("#")[0]).resolve()
        assert path.is_relative_to(ROOT), f"{document.name}: {target} leaves the repository"
        assert path.exists(), f"{document.name}: {target} does not exist"


@pytest.mark.multiprocess
def test_the_quickstart_runs_as_written(smollm2, tmp_path):
    """`reconfig up` exactly as `make run` starts it (default model, ports and layout), then every command of the
    README in order; each must exit 0. Its own run directory: it shares nothing with a developer's stack."""
    text = README.read_text()
    env = {**os.environ, "RECONFIG_RUN_DIR": str(tmp_path / "run"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # the venv, activated
    process = subprocess.Popen([sys.executable, "-m", "services.cli", "up"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        info = json.loads(wait_for_stack_file(process, tmp_path / "run", timeout_s=300).read_text())
        assert (info["name"], info["router_http_address"]) == ("8000", "http://127.0.0.1:8000")
        wait_ready(info["router_http_address"], timeout_s=120, process=process)
        for command in console_commands(text):
            result = subprocess.run(["bash", "-o", "pipefail", "-c", command], env=env, capture_output=True,
                                    text=True, timeout=300)
            assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
            if command == "reconfigctl status":
                assert result.stdout.startswith("stack '8000', controller 127.0.0.1:50051\ntopology: tp1pp4")
        for block in fenced(text, "python"):
            result = subprocess.run([sys.executable, "-c", block], env=env, capture_output=True, text=True,
                                    timeout=300)
            assert result.returncode == 0 and result.stdout.strip(), result.stderr[-2000:]
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    assert "context      " in process.stdout.read()  # the up line says how long a request may be, and why
