"""stageserve/generated/ must be exactly what protos/ compiles to."""

from __future__ import annotations

from pathlib import Path

from stageserve import protogen

FIX = "stageserve/generated is stale: run `python -m stageserve.protogen` and commit the result"


def test_generated_modules_are_fresh(tmp_path: Path):
    written = protogen.generate(tmp_path)
    assert written, "protoc produced nothing"
    fresh = {p.name for p in tmp_path.iterdir() if p.is_file()}
    committed = {
        p.name
        for p in protogen.GENERATED_DIR.iterdir()
        if p.is_file() and p.suffix in (".py", ".pyi")
    }
    # every proto compiles to _pb2.py, _pb2.pyi and _pb2_grpc.py
    protos = sorted(p.stem for p in protogen.PROTO_DIR.glob("*.proto"))
    assert protos, "no protos found"
    for stem in protos:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert stem + suffix in fresh
    assert fresh == committed, f"{FIX}: files differ {sorted(fresh ^ committed)}"
    for name in sorted(fresh):
        new = (tmp_path / name).read_text()
        old = (protogen.GENERATED_DIR / name).read_text()
        assert new == old, f"{FIX} ({name} differs)"


def test_rewrites_use_private_pool_and_package_imports(tmp_path: Path):
    protogen.generate(tmp_path)
    for path in tmp_path.glob("*_pb2.py"):
        text = path.read_text()
        assert "_descriptor_pool.Default()" not in text
        assert "from stageserve.generated._pool import POOL as _POOL" in text
        for line in text.splitlines():
            assert not (line.startswith("import ") and "_pb2" in line), line
