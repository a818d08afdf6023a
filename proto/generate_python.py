"""Generates the Python stubs for the hookwire contract.

    python proto/generate_python.py            # writes client/hookwire/v1/
    python proto/generate_python.py --out DIR  # writes DIR/hookwire/v1/ (drift check)

The stubs are committed; tests/unit/test_generated_stubs.py regenerates them
into a temporary folder and fails when they differ from the committed ones.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile

import grpc_tools
from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE = pathlib.Path("hookwire") / "v1"
INIT = '"""Generated protobuf and gRPC stubs for hookwire.v1 (do not edit)."""\n'


def generate(out_root: pathlib.Path) -> pathlib.Path:
    """Writes the stubs under ``out_root/hookwire/v1`` and returns that folder."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE).glob("*.proto"))
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        target = out_root / PACKAGE
        if target.exists():
            for old in target.glob("*_pb2*.py*"):
                old.unlink()
        target.mkdir(parents=True, exist_ok=True)
        for produced in sorted((pathlib.Path(tmp) / PACKAGE).iterdir()):
            shutil.copyfile(produced, target / produced.name)
        (target / "__init__.py").write_text(INIT)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "client", help="root of the output tree")
    ns = parser.parse_args()
    target = generate(ns.out)
    print(f"wrote {target}", file=sys.stderr)


if __name__ == "__main__":
    main()
