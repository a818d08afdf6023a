"""The committed hookwire.v1 stubs are exactly what proto/generate_python.py produces."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "proto" / "generate_python.py"
COMMITTED = ROOT / "client" / "hookwire" / "v1"
DRIFT = "stubs drifted: run `make proto`"


def load_generator():
    spec = importlib.util.spec_from_file_location("_hookwire_generate_python", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stub_files(folder: pathlib.Path) -> dict[str, bytes]:
    """Regular files of a stub folder (caches and hidden files aside)."""
    return {
        p.name: p.read_bytes()
        for p in sorted(folder.iterdir())
        if p.is_file() and not p.name.startswith(".") and p.suffix != ".pyc"
    }


def test_generated_stubs_match_committed(tmp_path):
    generated_dir = load_generator().generate(tmp_path)
    assert generated_dir == tmp_path / "hookwire" / "v1"
    generated = stub_files(generated_dir)
    committed = stub_files(COMMITTED)
    assert generated, "the generator produced no files"
    missing = sorted(set(generated) - set(committed))
    extra = sorted(set(committed) - set(generated))
    assert not missing, f"{DRIFT} (not committed: {missing})"
    assert not extra, f"{DRIFT} (committed but not generated: {extra})"
    differing = sorted(name for name in generated if generated[name] != committed[name])
    assert not differing, f"{DRIFT} (differ: {differing})"


def test_every_proto_has_its_stubs(tmp_path):
    protos = sorted(p.stem for p in (ROOT / "proto" / "hookwire" / "v1").glob("*.proto"))
    assert protos
    names = set(stub_files(COMMITTED))
    for stem in protos:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert f"{stem}{suffix}" in names, DRIFT
    assert "__init__.py" in names, DRIFT
