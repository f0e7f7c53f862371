"""An install without torch, as `pip install stageserve` without the [torch] extra.

A `torch` package first on PYTHONPATH whose import raises the
ModuleNotFoundError a missing package raises: every process started with
that PYTHONPATH (the stages a stack or `stageserve up` starts inherit it)
sees no torch, while the test process keeps its own to write models.
"""

from __future__ import annotations

import os
from pathlib import Path

TORCH_FIX = "pip install 'stageserve[torch]'"

_NO_TORCH = "raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n"


def torchless_path(tmp_path: Path) -> str:
    """A PYTHONPATH on which `import torch` raises ModuleNotFoundError."""
    blocker = tmp_path / "no_torch"
    (blocker / "torch").mkdir(parents=True, exist_ok=True)
    (blocker / "torch" / "__init__.py").write_text(_NO_TORCH)
    return os.pathsep.join(p for p in (str(blocker), os.environ.get("PYTHONPATH", "")) if p)
