"""The pure decisions behind draining a version a reload removed: which
versions drain (services/gateway/model_lifecycle.py removed_versions) and which hosted
instances a worker unloads given a record with draining versions
(services/worker/stale.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.gateway.model_lifecycle import removed_versions
from services.gateway.model_table import READY, UNAVAILABLE, ModelEntry
from services.worker.stale import stale_instances
from stageserve.config import to_spec
from stageserve.generated import model_config_pb2 as mc
from stageserve.model_state import LoadedModel


@dataclass
class Inst:
    model: str
    version: int
    generation: int


def _loaded(generation: int, versions: tuple[int, ...], draining: tuple[int, ...] = ()):
    config = mc.ModelConfig(
        name="m",
        platform="onnxruntime_onnx",
        input=[mc.ModelInput(name="X", data_type=mc.TYPE_FP32, dims=[4])],
        output=[mc.ModelOutput(name="Y", data_type=mc.TYPE_FP32, dims=[4])],
    )
    return LoadedModel(
        "m", generation, versions, Path("/r/m"), config, to_spec(config), "", draining
    )


def test_removed_ready_versions_drain_whatever_their_requests_now() -> None:
    old = ModelEntry("m", versions={1: READY, 2: READY, 3: UNAVAILABLE})
    assert removed_versions(old, None, (2, 4)) == (1,)  # 3 never served: nothing to drain
    assert removed_versions(old, None, (1, 2)) == ()
    assert removed_versions(None, None, (1,)) == ()  # a first load


def test_a_reload_during_a_drain_keeps_draining_what_it_does_not_serve() -> None:
    old = ModelEntry("m", versions={2: READY})
    published = _loaded(5, (2,), draining=(1,))
    assert removed_versions(old, published, (3,)) == (1, 2)
    assert removed_versions(old, published, (1, 3)) == (2,)  # 1 is served again


def test_draining_version_keeps_its_old_instances() -> None:
    v1_old, v2_new = Inst("m", 1, 4), Inst("m", 2, 5)
    assert stale_instances([v1_old, v2_new], {"m": _loaded(5, (2,), draining=(1,))}) == []


def test_version_unloads_once_the_drain_ends() -> None:
    v1_old, v2_new = Inst("m", 1, 4), Inst("m", 2, 5)
    assert stale_instances([v1_old, v2_new], {"m": _loaded(5, (2,))}) == [v1_old]


def test_old_generation_goes_only_once_the_new_one_is_hosted() -> None:
    old = Inst("m", 1, 4)
    assert stale_instances([old], {"m": _loaded(5, (1,))}) == []  # new one not loaded yet
    new = Inst("m", 1, 5)
    assert stale_instances([old, new], {"m": _loaded(5, (1,))}) == [old]


def test_unpublished_model_goes_whole() -> None:
    insts = [Inst("m", 1, 4), Inst("m", 2, 4)]
    assert stale_instances(insts, {}) == insts
