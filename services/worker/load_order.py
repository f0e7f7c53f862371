"""The order a worker loads the published models in (pure).

Each model serves as soon as it is loaded: the worker registers its
instances after every load, as Triton marks each model READY on its own,
so a restarted worker takes requests for its first models while the others
load. The first TorchScript model of a process pays torch's import, most of
a restart's load time: on the 2-core VM a restarted worker of the example
repository loaded its models in 1.85 s, 1.6 s of it the first TorchScript
model (`torch_two_io`), and every model loaded after it, `simple` among
them, waited for that import. So the models whose backend is imported
already, or needs no import of its own, load first; the order is otherwise
the published one.
"""

from __future__ import annotations

from collections.abc import Iterable

from stageserve.config import PYTORCH_PLATFORM
from stageserve.model_state import LoadedModel


def load_order(models: Iterable[LoadedModel], torch_imported: bool) -> list[LoadedModel]:
    """`models` with the TorchScript ones last while torch is not imported yet."""

    def waits_for_an_import(model: LoadedModel) -> bool:
        return model.spec.platform == PYTORCH_PLATFORM and not torch_imported

    return sorted(models, key=waits_for_an_import)  # stable: the published order otherwise
