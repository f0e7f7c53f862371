"""A backend dependency this install lacks: the load error names it and the fix."""

from __future__ import annotations

import sys
from pathlib import Path

import onnxruntime as ort
import pytest

from services.worker.backends import BackendError, install_hint
from services.worker.python_backend.instance import PythonModelError
from services.worker.python_backend.loader import ModelImportError, import_model_file
from services.worker.python_backend.process_instance import ProcessInstance
from services.worker.tensor_sessions import create_backend
from stageserve.config import parse_config_text, read_config, to_spec
from stageserve_tools import examples
from stageserve_tools.examples import python_config_text

NO_CUDA_EP = "CUDAExecutionProvider" not in ort.get_available_providers()


def _block_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import torch` (and of any torch submodule another test imported) raises
    ModuleNotFoundError, as on an install without torch."""
    for name in [n for n in sys.modules if n == "torch" or n.startswith("torch.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "torch", None)


def test_install_hints() -> None:
    assert install_hint("torch") == "install it with: pip install 'stageserve[torch]'"
    assert install_hint("torch.utils.dlpack") == "install it with: pip install 'stageserve[torch]'"
    assert "the package that provides 'cv2'" in install_hint("cv2.dnn")


def test_a_torchscript_model_without_torch_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "torch_model" / "config.pbtxt"
    config.parent.mkdir()
    config.write_text(
        'name: "torch_model"\nplatform: "pytorch_libtorch"\nmax_batch_size: 0\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    )
    spec = to_spec(read_config(config.parent))
    _block_torch(monkeypatch)
    with pytest.raises(BackendError) as e:
        create_backend(spec, config.parent / "1" / "model.pt", "cpu", 1)
    message = str(e.value)
    assert "model 'torch_model'" in message
    assert "needs 'torch'" in message
    assert "pip install 'stageserve[torch]'" in message


def _simple_spec(root: Path, kind: str):
    examples.write_simple(root, "simple", max_batch_size=8)
    config = root / "simple" / "config.pbtxt"
    config.write_text(config.read_text() + f"\ninstance_group [ {{ kind: {kind} }} ]\n")
    return to_spec(read_config(root / "simple")), root / "simple" / "1" / "model.onnx"


@pytest.mark.skipif(not NO_CUDA_EP, reason="this onnxruntime has the CUDA EP")
def test_a_gpu_instance_without_the_cuda_ep_fails_its_load(tmp_path: Path) -> None:
    """Triton's onnxruntime backend without GPU support: "GPU instances not supported"."""
    spec, path = _simple_spec(tmp_path, "KIND_GPU")
    with pytest.raises(BackendError, match="GPU instances not supported") as e:
        create_backend(spec, path, "cuda:0", 1, require_gpu=True)
    assert "onnxruntime-gpu" in str(e.value)
    assert "KIND_CPU" in str(e.value)


def test_a_gpu_instance_on_a_torch_without_cuda_fails_its_load(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA device")
    from stageserve_tools.torch_examples import write_torch_two_io

    model_dir = write_torch_two_io(tmp_path)
    spec = to_spec(read_config(model_dir))
    path = model_dir / "1" / spec.model_filename
    with pytest.raises(BackendError, match="GPU instances not supported: torch") as e:
        create_backend(spec, path, "cuda:0", 1, require_gpu=True)
    assert "CUDA build of torch" in str(e.value)
    assert create_backend(spec, path, "cuda:0", 1).device == "cpu"  # KIND_AUTO: falls back


@pytest.mark.skipif(not NO_CUDA_EP, reason="this onnxruntime has the CUDA EP")
def test_an_auto_instance_on_a_gpu_worker_falls_back_to_the_cpu(tmp_path: Path) -> None:
    spec, path = _simple_spec(tmp_path, "KIND_AUTO")
    session = create_backend(spec, path, "cuda:0", 1)
    assert session.device == "cpu"


def test_a_model_py_import_names_the_missing_package(tmp_path: Path) -> None:
    model = tmp_path / "model.py"
    model.write_text("import stageserve_test_absent.sub\n\nclass TritonPythonModel:\n    pass\n")
    with pytest.raises(ModelImportError) as e:
        import_model_file(model)
    message = str(e.value)
    assert "No module named 'stageserve_test_absent'" in message
    assert "install the package that provides 'stageserve_test_absent'" in message


def test_a_model_py_that_needs_torch_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model.py moving tensors through DLPack with torch, on a torch-less install."""
    _block_torch(monkeypatch)
    model = tmp_path / "model.py"
    model.write_text(
        "from torch.utils.dlpack import from_dlpack\n\nclass TritonPythonModel:\n    pass\n"
    )
    with pytest.raises(ModelImportError, match=r"pip install 'stageserve\[torch\]'"):
        import_model_file(model)


def test_a_stub_process_instance_names_the_missing_package(tmp_path: Path) -> None:
    """The model.py runs in a stub process of its own: the same reason comes back."""
    text = python_config_text(
        "m", [("IN", "FP32", (2,))], [("OUT", "FP32", (2,))], max_batch_size=0
    )
    (tmp_path / "1").mkdir()
    path = tmp_path / "1" / "model.py"
    path.write_text("import stageserve_test_absent\n\nclass TritonPythonModel:\n    pass\n")
    with pytest.raises(PythonModelError) as e:
        ProcessInstance(
            path,
            to_spec(parse_config_text(text)),
            "{}",
            instance_name="m_0_0",
            kind="KIND_CPU",
            device_id=-1,
            version=1,
        )
    assert "No module named 'stageserve_test_absent'" in str(e.value)
    assert "install the package that provides 'stageserve_test_absent'" in str(e.value)
