"""Regenerate the protobuf/gRPC code from protos/ (`make protos`); never edit the output by hand."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "services" / "rpc"
_ABSOLUTE_IMPORT = re.compile(r"^from reconfig\.v1 import", re.MULTILINE)


def generate(out_dir: Path = OUT_DIR) -> list[Path]:
    """Run protoc on every proto; rewrite imports so the code lives in the `services.rpc` package."""
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    written = []
    for path in sorted(p for p in (out_dir / "reconfig").rglob("*_pb2*.py*") if p.suffix in (".py", ".pyi")):
        path.write_text(_ABSOLUTE_IMPORT.sub("from services.rpc.reconfig.v1 import", path.read_text()))
        written.append(path)
    for package in (out_dir / "reconfig", out_dir / "reconfig" / "v1"):
        (package / "__init__.py").touch()
    return written


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT_DIR):
        print(path)
