"""The child process of Triton's auto-complete for Python models
(stageserve/python_autocomplete.py starts it with `python -m` this module):
it imports each model.py it is sent, with pb_utils registered, and answers
with the configuration its `auto_complete_config` returns.

One JSON job per stdin line, one JSON answer per stdout line; whatever a
model prints goes to stderr so it cannot spoil an answer.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from services.worker.python_backend import pb_utils
from services.worker.python_backend.loader import ModelImportError, import_model_file


def _complete_in_this_process(job: dict) -> dict:
    """The child's work: the answer as {"config": ...} or {"error": ...}."""
    name = job["config"].get("name", "")
    try:
        module = import_model_file(Path(job["model_file"]))
    except ModelImportError as exc:
        return {"error": str(exc)}
    hook = getattr(module.TritonPythonModel, "auto_complete_config", None)
    if hook is None:
        return {"config": job["config"]}
    completed = pb_utils.ModelConfig(json.dumps(job["config"]))
    try:
        result = hook(completed)
        return {"config": (result if result is not None else completed).as_dict()}
    except (ValueError, TypeError) as exc:
        return {"error": f"auto-complete of model '{name}' failed: {type(exc).__name__}: {exc}"}
    except Exception as exc:  # the model's own code
        return {
            "error": f"auto_complete_config of model '{name}' raised {type(exc).__name__}: {exc}"
        }


def _child_main() -> None:
    """One answer line per job line, until stdin closes (its parent is gone)."""
    # The answers go to the real stdout; whatever a model prints goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        answers.write(json.dumps(_complete_in_this_process(json.loads(line))) + "\n")
        answers.flush()


if __name__ == "__main__":
    _child_main()
