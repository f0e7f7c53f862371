"""The import-linter contracts in pyproject.toml ([tool.importlinter]): the tree
keeps them, and each one breaks on an import that crosses its line.

The violating imports are written into a copy of the packages, never the tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("stageserve", "stageserve_tools", "services")
LINT = (
    "import sys; from importlinter.cli import lint_imports_command; "
    "sys.exit(lint_imports_command())"
)


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", LINT, "--no-cache"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_tree_keeps_its_import_contracts() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "violation", "broken"),
    [
        # the kernel importing a service
        ("stageserve/names.py", "services.gateway.model_table", "Services and tools sit on"),
        # a service importing another service
        ("services/worker/warmup.py", "services.gateway.model_table", "Services import nothing"),
        # a service importing the tools package
        ("services/scheduler/batcher.py", "stageserve_tools.examples", "Services and tools sit"),
        # a kernel module importing the entry module, and through it every service
        ("stageserve/launcher.py", "stageserve.cli", "Nothing in the runtime imports"),
    ],
)
def test_a_crossing_import_breaks_its_contract(
    tmp_path: Path, module: str, violation: str, broken: str
) -> None:
    for package in PACKAGES:
        shutil.copytree(
            ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    assert _lint(tmp_path).returncode == 0  # the copy alone keeps them
    with (tmp_path / module).open("a") as f:
        f.write(f"\nimport {violation}  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    broken_lines = [line for line in result.stdout.splitlines() if " BROKEN" in line]
    assert any(line.startswith(broken) for line in broken_lines), result.stdout
    importer = module.removesuffix(".py").replace("/", ".")
    assert importer in result.stdout, result.stdout  # the report names the importer


def test_the_import_graph_in_the_docs_names_every_module() -> None:
    """docs/architecture.md's import graph lists the modules of each layer: a
    module added, renamed or deleted without it fails here."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    graph = text[text.index("## Import graph") :]
    graph = graph[: graph.index("\n## ", 1)]
    named = {word.strip("`(),;:.") for word in graph.split()}
    # bare module names; a path (tests/...) or a user's model.py is prose
    named = {w for w in named if w.endswith(".py") and "/" not in w and w != "model.py"}
    files = {
        p.name
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if p.name != "__init__.py" and "generated" not in p.parts
    }
    assert files - named == set(), "modules missing from the import graph"
    assert named - files == set(), "the import graph names modules that do not exist"
