"""The committed generated code is what `make protos` produces from protos/ today."""

from __future__ import annotations

from services.rpc.generate import OUT_DIR, generate


def test_generated_code_is_current(tmp_path):
    fresh = {p.relative_to(tmp_path): p.read_text() for p in generate(tmp_path)}
    committed = {p.relative_to(OUT_DIR): p.read_text() for p in (OUT_DIR / "reconfig").rglob("*_pb2*.py*")
                 if p.suffix in (".py", ".pyi")}  # not the interpreter's __pycache__/*.pyc
    assert fresh.keys() == committed.keys(), "run `make protos`"
    stale = [str(path) for path, text in fresh.items() if committed[path] != text]
    assert not stale, f"generated code is stale (run `make protos`): {stale}"
