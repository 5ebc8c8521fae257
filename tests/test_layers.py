"""The code's shape (docs/architecture.md): the packages of services/ form one-way layers with no import circle in
or between them (import-linter's contracts in pyproject.toml), every package has its place in those layers, and
no module or function grows past what a reader holds in view."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ROOT / "services"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def _hand_written() -> list[Path]:
    """Every module of services/ but protoc's output (services/rpc/reconfig/v1/*_pb2*.py)."""
    return sorted(p for p in SERVICES.rglob("*.py") if "_pb2" not in p.name)


def test_import_contracts_hold():
    """`lint-imports`: the layer order, no worker code in the router, controller or front, no circle anywhere."""
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout and result.stdout.count("KEPT") >= 3, result.stdout


def test_every_package_has_a_layer():
    """A new package (or top-level module) of services/ must be placed in the layers, not left outside them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers")["layers"]
    placed = {name.strip() for layer in layers for name in layer.split("|")}
    present = {f"services.{p.stem if p.is_file() else p.name}" for p in SERVICES.iterdir()
               if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert present - placed == set(), f"add these to [tool.importlinter] layers in pyproject.toml: {present - placed}"
    assert placed - present == set(), f"layers name packages that do not exist: {placed - present}"


def oversized(source: str, name: str) -> list[str]:
    """What in `source` (a module called `name`) breaks the size rules."""
    found = []
    if (lines := len(source.splitlines())) > MAX_MODULE_LINES:
        found.append(f"{name}: {lines} lines (at most {MAX_MODULE_LINES}: split it by responsibility)")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} {node.name}: {length} lines (at most {MAX_FUNCTION_LINES}: "
                             "name its phases as functions)")
    return found


def test_no_module_or_function_too_long():
    found = [problem for path in _hand_written()
             for problem in oversized(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == [], "\n".join(found)


def test_the_size_rule_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert oversized(f"def long():\n{body}\n", "m.py") == [
        f"m.py:1 long: {MAX_FUNCTION_LINES + 1} lines (at most {MAX_FUNCTION_LINES}: name its phases as functions)"]
    assert oversized("def short():\n    return 1\n", "m.py") == []
