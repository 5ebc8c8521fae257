"""The test suite's own hygiene, read from its syntax trees: waits poll a state with a deadline (tests/conftest.py's
until() or wait_until()), never a guessed delay or a loop that can spin forever (a hang becomes a silent suite
timeout); shared helpers live in conftest.py or a helper module, not in another test module."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# The waits themselves: the only loops allowed to sleep.
WAIT_IMPLEMENTATIONS = {("tests/conftest.py", "until"), ("tests/conftest.py", "wait_until")}
TAG = "# not synchronisation:"
SLEEP_MODULES = ("asyncio", "time")


def _module_of(path: str) -> tuple[str, bool]:
    """The dotted module `path` (relative to the repository root) defines, and whether it is a package."""
    parts = list(Path(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _resolve(node: ast.ImportFrom, path: str) -> str:
    """The absolute module a `from … import` reads, relative levels resolved against `path`."""
    if not node.level:
        return node.module or ""
    module, is_package = _module_of(path)
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_tests_module(module: str) -> bool:
    return module == "tests" or module.startswith("tests.")


def _tagged_lines(source: str) -> set[int]:
    """Lines whose comment says why their sleep is not synchronisation."""
    return {token.start[0] for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type == tokenize.COMMENT and token.string.startswith(TAG)}


class _Scanner(ast.NodeVisitor):
    def __init__(self, source: str, path: str):
        self.path = path
        self.tagged = _tagged_lines(source)
        self.problems: list[str] = []
        self.sleep_modules: set[str] = set()  # local names bound to asyncio / time
        self.sleep_names: set[str] = set()  # local names bound to asyncio.sleep / time.sleep
        self.functions: list[str] = []
        self.loops = 0

    def report(self, node: ast.AST, problem: str) -> None:
        self.problems.append(f"{self.path}:{node.lineno}: {problem}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name in SLEEP_MODULES:
                self.sleep_modules.add(alias.asname or alias.name)
            if _is_tests_module(alias.name) and any(part.startswith("test_") for part in alias.name.split(".")):
                self.report(node, f"imports test module {alias.name}: move what it shares to a conftest.py or "
                                  "helper module (not named test_*) and import it from there")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = _resolve(node, self.path)
        for alias in node.names:
            if module in SLEEP_MODULES and alias.name == "sleep":
                self.sleep_names.add(alias.asname or alias.name)
        if not _is_tests_module(module):
            return
        if module.rsplit(".", 1)[-1].startswith("test_"):
            self.report(node, f"imports from test module {module}: move what it shares to a conftest.py or helper "
                              "module (not named test_*) and import it from there")
        for alias in node.names:
            if alias.name.startswith("test_"):
                self.report(node, f"imports test module {module}.{alias.name}: move what it shares to a conftest.py "
                                  "or helper module (not named test_*) and import it from there")
            elif alias.name.startswith("_"):
                self.report(node, f"imports private name {alias.name} from {module}: a shared helper gets a public "
                                  "name")

    def _is_sleep(self, call: ast.Call) -> bool:
        func = call.func
        if isinstance(func, ast.Name):
            return func.id in self.sleep_names
        return (isinstance(func, ast.Attribute) and func.attr == "sleep" and isinstance(func.value, ast.Name)
                and func.value.id in self.sleep_modules)

    def visit_Call(self, node: ast.Call) -> None:
        if self._is_sleep(node):
            allowed = self.functions and (self.path, self.functions[-1]) in WAIT_IMPLEMENTATIONS
            if self.loops and not allowed:
                self.report(node, "sleeps in a while loop, which polls with no deadline (or a hand-made one): "
                                  "wait with `await until(predicate, what=...)` or `wait_until(...)` from "
                                  "tests/conftest.py")
            elif not self.loops and not _is_zero(node) and not (
                    set(range(node.lineno, node.end_lineno + 1)) & self.tagged):
                self.report(node, "sleeps a fixed time: wait on the state the test needs with until()/wait_until() "
                                  f"from tests/conftest.py, or, if the delay is not synchronisation (time that must "
                                  f"pass, pacing, an injected delay), say why on its line: `{TAG} <why>`")
        self.generic_visit(node)

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        # A function defined in a loop does not run in it; one defined in a function is its own scope.
        self.functions.append(node.name)
        loops, self.loops = self.loops, 0
        self.generic_visit(node)
        self.loops = loops
        self.functions.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_function

    def visit_While(self, node: ast.While) -> None:
        self.visit(node.test)
        self.loops += 1
        for statement in node.body + node.orelse:
            self.visit(statement)
        self.loops -= 1


def _is_zero(call: ast.Call) -> bool:
    """`sleep(0)`: one turn of the event loop, not a delay."""
    delay = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg in ("delay", "seconds")),
                                                None)
    return isinstance(delay, ast.Constant) and delay.value == 0


def hygiene_problems(source: str, path: str) -> list[str]:
    """`file:line: problem` for each breach in `source`, the text of `path` (relative to the repository root)."""
    scanner = _Scanner(source, path)
    scanner.visit(ast.parse(source, filename=path))
    return scanner.problems


def test_the_tests_wait_on_states_and_share_helpers_through_helper_modules():
    problems = [problem for file in sorted(TESTS.rglob("*.py"))
                for problem in hygiene_problems(file.read_text(), file.relative_to(ROOT).as_posix())]
    assert not problems, "test hygiene:\n" + "\n".join(problems)


# The scanner itself, on snippets it must flag and snippets it must pass.

def test_a_sleep_in_a_while_loop_is_reported_whatever_its_import_spelling():
    for source in ("import asyncio\nasync def f():\n    while not ready:\n        await asyncio.sleep(0.1)\n",
                   "import time\ndef f():\n    while True:\n        if ready():\n            break\n"
                   "        time.sleep(0)\n",
                   "from time import sleep\ndef f():\n    while not ready():\n        sleep(1)\n",
                   "import time as clock\ndef f():\n    while not ready():\n        clock.sleep(1)  "
                   f"{TAG} tagged or not, a loop polls\n",
                   "from asyncio import sleep as pause\nasync def f():\n    while x:\n        await pause(1)\n"):
        problems = hygiene_problems(source, "tests/x/test_a.py")
        assert len(problems) == 1 and "while loop" in problems[0] and "until(" in problems[0], source
        assert problems[0].startswith("tests/x/test_a.py:"), problems


def test_a_fixed_sleep_is_reported_unless_it_says_why_it_is_not_synchronisation():
    bad = "import asyncio\nasync def f():\n    start()\n    await asyncio.sleep(0.2)\n    assert done()\n"
    assert hygiene_problems(bad, "tests/test_a.py") == [
        f"tests/test_a.py:4: sleeps a fixed time: wait on the state the test needs with until()/wait_until() from "
        f"tests/conftest.py, or, if the delay is not synchronisation (time that must pass, pacing, an injected "
        f"delay), say why on its line: `{TAG} <why>`"]
    tagged = bad.replace("sleep(0.2)", f"sleep(0.2)  {TAG} shows nothing happens meanwhile")
    yielding = bad.replace("sleep(0.2)", "sleep(0)")
    unrelated = "def f(pacer):\n    pacer.sleep(1)\n    while x:\n        fake.sleep(1)\n"
    assert hygiene_problems(tagged, "tests/test_a.py") == []
    assert hygiene_problems(yielding, "tests/test_a.py") == []
    assert hygiene_problems(unrelated, "tests/test_a.py") == []


def test_only_the_wait_implementations_may_sleep_in_a_loop():
    source = "import asyncio\nasync def until(p):\n    while True:\n        await asyncio.sleep(0.01)\n"
    assert hygiene_problems(source, "tests/conftest.py") == []
    assert len(hygiene_problems(source, "tests/router/conftest.py")) == 1
    # A helper defined inside the wait is its own function; a loop around a def does not run the def's body.
    nested = "import time\ndef until(p):\n    def g():\n        while True:\n            time.sleep(1)\n"
    assert len(hygiene_problems(nested, "tests/conftest.py")) == 1
    looped = "import time\nwhile True:\n    def g():\n        time.sleep(1)  # not synchronisation: x\n"
    assert hygiene_problems(looped, "tests/test_a.py") == []


def test_imports_from_test_modules_and_of_private_names_are_reported():
    cases = {
        "from tests.router.test_scheduler import seq_of\n": "imports from test module tests.router.test_scheduler",
        "import tests.router.test_scheduler\n": "imports test module tests.router.test_scheduler",
        "from tests.router import test_scheduler\n": "imports test module tests.router.test_scheduler",
        "from .test_scheduler import seq_of\n": "imports from test module tests.router.test_scheduler",
        "from tests.conftest import _decisive_init\n": "imports private name _decisive_init from tests.conftest",
        "from .conftest import _helper\n": "imports private name _helper from tests.router.conftest",
    }
    for source, problem in cases.items():
        problems = hygiene_problems(source, "tests/router/test_engine.py")
        assert len(problems) == 1 and problem in problems[0], (source, problems)
    fine = ("from tests.conftest import until\nfrom tests.router.fakes import PagedWorkers\n"
            "from services.router.engine import _internal\nfrom .conftest import MODEL\n")
    assert hygiene_problems(fine, "tests/router/test_engine.py") == []
    assert len(hygiene_problems("from ..test_cli import x\n", "tests/router/__init__.py")) == 1
