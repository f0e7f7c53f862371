"""Whether and how model configs are auto-completed (stageserve/autocomplete.py).

Standard library only: the CLI imports it, and so do tools that parse the
CLI's arguments without the serving dependencies (deploy/checks.py).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BATCH_SIZE = 4  # Triton's --backend-config=default-max-batch-size


@dataclass(frozen=True)
class AutoComplete:
    enabled: bool = True
    default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE


TRITON_DEFAULT = AutoComplete()
