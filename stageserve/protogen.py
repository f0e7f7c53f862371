"""Generate stageserve/generated/ from protos/ with grpcio-tools.

Run `python -m stageserve.protogen` after editing a .proto file; the test
suite fails if the committed modules are stale.

Two mechanical rewrites follow protoc:
- imports between generated modules become package imports;
- descriptors go into a StageServe-private descriptor pool instead of
  protobuf's default one, because tritonclient registers the very same
  `inference.*` symbols in the default pool and both must live in one
  process (tests, benchmarks).
"""

from __future__ import annotations

import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "protos"
GENERATED_DIR = Path(__file__).resolve().parent / "generated"
PACKAGE = "stageserve.generated"

_IMPORT_RE = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)


def _rewrite(source: str) -> str:
    source = _IMPORT_RE.sub(rf"from {PACKAGE} import \1 as \2", source)
    source = source.replace(
        "from google.protobuf import descriptor_pool as _descriptor_pool\n",
        f"from {PACKAGE}._pool import POOL as _POOL\n",
    )
    return source.replace("_descriptor_pool.Default()", "_POOL")


def generate(out_dir: Path) -> list[Path]:
    """Compile every protos/*.proto into out_dir; returns the files written."""
    from grpc_tools import protoc

    include = str(resources.files("grpc_tools") / "_proto")
    protos = sorted(str(p) for p in PROTO_DIR.glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {protos}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for produced in sorted(Path(tmp).iterdir()):
            target = out_dir / produced.name
            target.write_text(_rewrite(produced.read_text()))
            written.append(target)
    (out_dir / "__init__.py").write_text('"""Generated from protos/ by stageserve.protogen."""\n')
    (out_dir / "_pool.py").write_text(
        '"""Private descriptor pool for StageServe\'s generated protos (see protogen)."""\n\n'
        "from google.protobuf import descriptor_pool\n\n"
        "POOL = descriptor_pool.DescriptorPool()\n"
    )
    return written


def main() -> int:
    written = generate(GENERATED_DIR)
    print(f"generated {len(written)} files into {GENERATED_DIR}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
