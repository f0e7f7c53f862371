"""services/worker/load_order.py: TorchScript models load last until torch is
imported; the published order holds otherwise."""

from __future__ import annotations

from pathlib import Path

from services.worker.load_order import load_order
from stageserve.config import to_spec
from stageserve.generated import model_config_pb2 as mc
from stageserve.model_state import LoadedModel


def _model(name: str, platform: str = "", backend: str = "") -> LoadedModel:
    config = mc.ModelConfig(
        name=name,
        platform=platform,
        backend=backend,
        input=[mc.ModelInput(name="X", data_type=mc.TYPE_FP32, dims=[4])],
        output=[mc.ModelOutput(name="Y", data_type=mc.TYPE_FP32, dims=[4])],
    )
    return LoadedModel(name, 1, (1,), Path(f"/r/{name}"), config, to_spec(config))


def _names(models: list[LoadedModel]) -> list[str]:
    return [m.name for m in models]


PUBLISHED = [
    _model("torch_a", platform="pytorch_libtorch"),
    _model("onnx_a", platform="onnxruntime_onnx"),
    _model("py_a", backend="python"),
    _model("torch_b", backend="pytorch"),
    _model("onnx_b", platform="onnxruntime_onnx"),
]


def test_torchscript_models_wait_for_the_others_before_torch_is_imported() -> None:
    assert _names(load_order(PUBLISHED, torch_imported=False)) == [
        "onnx_a",
        "py_a",
        "onnx_b",
        "torch_a",
        "torch_b",
    ]


def test_once_torch_is_imported_the_published_order_holds() -> None:
    assert _names(load_order(PUBLISHED, torch_imported=True)) == _names(PUBLISHED)
