"""The tensor session of one ONNX or TorchScript model instance, from its ModelSpec.

ONNX Runtime for ``onnxruntime_onnx`` models, TorchScript for
``pytorch_libtorch`` ones; both answer ``run(feeds, output_names)`` on
StageServe's numpy tensors (see onnx_backend / torch_backend), and
``TensorBatches`` hosts either as an instance.
"""

from __future__ import annotations

from pathlib import Path

from services.worker.backends import (
    BackendError,
    InstanceBackend,
    TensorBackend,
    missing_dependency,
    parse_device,
)
from services.worker.instances import BackendMaker, Placement, default_intra_op_threads
from services.worker.onnx_backend import OnnxInstance
from services.worker.onnx_options import ort_options, parse_int
from services.worker.tensor_batches import TensorBatches
from stageserve.config import ONNX_PLATFORM, PYTORCH_PLATFORM, InstanceGroup, ModelSpec
from stageserve.model_state import LoadedModel
from stageserve.pad_policy import ON


def input_types(spec: ModelSpec) -> dict[str, str]:
    """Declared inputs plus what no request carries (controls, states, batch inputs)."""
    return {**{t.name: t.datatype.triton for t in spec.inputs}, **spec.extra_inputs()}


def output_types(spec: ModelSpec) -> dict[str, str]:
    """Declared outputs plus implicit-state outputs (the scheduler reads those)."""
    out = {t.name: t.datatype.triton for t in spec.outputs}
    if spec.sequence is not None:
        out.update({s.output_name: s.datatype.triton for s in spec.sequence.states})
    return out


def create_backend(
    spec: ModelSpec, path: Path, device: str, threads: int, require_gpu: bool = False
) -> TensorBackend:
    """One instance's session for the model file at `path` on `device`.

    `require_gpu` (a KIND_GPU instance): a session that cannot use the GPU
    (an onnxruntime without the CUDA execution provider, a torch without
    CUDA) fails the load, as Triton's backends answer "GPU instances not
    supported" on a build without GPU support. Otherwise (KIND_AUTO on a GPU
    worker) the session falls back to the CPU with a warning."""
    if spec.platform == ONNX_PLATFORM:
        kind, device_id = parse_device(device)
        options = ort_options(
            spec.parameters,
            gpu=kind == "cuda",
            device_id=device_id,
            gpu_accelerators=spec.gpu_accelerators,
            cpu_accelerators=spec.cpu_accelerators,
            graph_level=spec.graph_level,
            # padded to one size where it runs on a GPU (pad_policy.py)
            one_shape=len(spec.pad_batch.sizes_for(on_gpu=True)) == 1,
        )
        return OnnxInstance(
            str(path),
            device=device,
            intra_op_threads=threads,
            input_types=input_types(spec),
            output_types=output_types(spec),
            cpu_fallback=not require_gpu,
            options=options,
        )
    if spec.platform == PYTORCH_PLATFORM:
        try:  # torch is the optional extra stageserve[torch]
            import torch  # noqa: F401

            from services.worker.torch_backend import TorchInstance
        except ImportError as exc:
            raise missing_dependency(
                f"model '{spec.name}' (platform {spec.platform})", exc
            ) from exc
        return TorchInstance(
            path,
            device=device,
            intra_op_threads=threads,
            input_types=input_types(spec),
            output_types=output_types(spec),
            parameters=spec.parameters,
            output_order=list(output_types(spec)),
            cpu_fallback=not require_gpu,
        )
    raise BackendError(f"model '{spec.name}': no worker backend for platform '{spec.platform}'")


def tensor_backends(
    model: LoadedModel, version: int, groups: list[tuple[InstanceGroup, list[Placement]]]
) -> BackendMaker:
    """What builds each instance of one ONNX or TorchScript model version.
    The cores are split between all its instances unless the model sets
    ``intra_op_thread_count``."""
    total = sum(len(places) for _, places in groups)
    threads = max(0, parse_int(model.spec.parameters.get("intra_op_thread_count", "0"))) or (
        default_intra_op_threads(total)
    )
    path = model.path / str(version) / model.spec.model_filename

    def make(place: Placement, group: InstanceGroup, index: int) -> InstanceBackend:
        session = create_backend(
            model.spec, path, place.device, threads, require_gpu=group.kind == "KIND_GPU"
        )
        # auto padding (pad_policy.py) where the session really runs on a GPU
        # (a KIND_AUTO instance may have fallen back to the CPU)
        pad_sizes = model.spec.pad_batch.sizes_for(on_gpu=session.device != "cpu")
        return TensorBatches(
            model.spec, session, pad_sizes, pad_asked=model.spec.pad_batch.mode == ON
        )

    return make
