"""An ONNX Runtime or TorchScript session as a hosted instance: one formed
batch in, its per-request results out.

The scheduler sends a batch as concatenated input tensors; this decodes them
into the shared numpy representation, adds Triton's batch_input tensors,
runs the session (``backends.TensorBackend``), and splits the outputs back
per request (BATCH_SCATTER_WITH_INPUT_SHAPE outputs by their source shapes).
An instance with `pad_sizes` pads the batch up to the nearest of them before
the run and drops the padded rows right after it (batch_padding.py), so
everything past the run, the statistics included, sees the real batch.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from services.worker import cuda_inplace
from services.worker.backends import BackendError, Emit, TensorBackend
from services.worker.batch_io import (
    BatchIOError,
    batch_input_array,
    request_shapes,
    scatter,
    scatter_shapes,
)
from services.worker.batch_padding import (
    BatchPaddingError,
    pad_feeds,
    padded_size,
    unpad_results,
)
from stageserve import tensor_shm
from stageserve.config import ModelSpec
from stageserve.datatypes import from_triton
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensor_shm import tensor_bytes
from stageserve.tensors import TensorError, numpy_to_raw, raw_to_numpy

if TYPE_CHECKING:
    from services.worker.device_batches import DeviceBatches

log = logging.getLogger(__name__)


def execute_delay_s(spec: ModelSpec) -> float:
    """Model parameter `execute_delay_ms`: a testing aid that makes every
    execution take at least that long (beyond Triton; think of a slow model)."""
    return float(spec.parameters.get("execute_delay_ms", "0") or 0) / 1000.0


class TensorBatches:
    """Executes formed batches of `spec` on one tensor session; `pad_sizes`:
    the batch sizes a formed batch is padded up to (empty: none)."""

    def __init__(
        self,
        spec: ModelSpec,
        session: TensorBackend,
        pad_sizes: tuple[int, ...] = (),
        pad_asked: bool = False,
    ) -> None:
        self.spec = spec
        self.session = session
        self.thread_bound = session.thread_bound
        self.delay_s = execute_delay_s(spec)
        self.pad_sizes = pad_sizes if spec.batching else ()
        # Asked for by the model (pad_batch set): a batch padding cannot serve
        # fails. By default (auto) such a model stops padding instead.
        self.pad_asked = pad_asked
        self._device: DeviceBatches | None = None  # the CUDA in-place path, made at first use

    def execute_batch(self, request: pb.ExecuteRequest, emit: Emit | None) -> pb.ExecuteResponse:
        """Decode, run and split one batch (`emit` is unused: not decoupled)."""
        if cuda_inplace.wanted(request):  # clients' CUDA regions, used on the device
            wanted = self._wanted_outputs(request)
            return self._on_device().execute(request, self.pad_sizes, wanted)
        t0 = time.monotonic_ns()
        try:
            feeds = {
                t.name: raw_to_numpy(tensor_bytes(t), t.datatype, t.shape) for t in request.inputs
            }
            feeds.update(self._batch_inputs(request))
        except (TensorError, BatchIOError) as exc:
            raise BackendError(f"bad input tensor: {exc}") from exc
        wanted = self._wanted_outputs(request)
        real = sum(request.request_batch_sizes)
        padded = padded_size(real, self.pad_sizes)
        try:
            padded_feeds = pad_feeds(feeds, real, padded)  # input work: before t1
            t1 = time.monotonic_ns()
            if self.delay_s:
                time.sleep(self.delay_s)
            results = unpad_results(self.session.run(padded_feeds, wanted), real, padded)
        except BatchPaddingError as exc:
            if self.pad_asked:
                raise BackendError(f"model '{self.spec.name}': {exc}") from exc
            log.warning(
                "batch padding off for this instance",
                extra={"model": self.spec.name, "reason": str(exc)},
            )
            self.pad_sizes = ()
            t1 = time.monotonic_ns()
            results = self.session.run(feeds, wanted)
        t2 = time.monotonic_ns()
        try:
            scattered = self._scatter(request, results)
        except BatchIOError as exc:
            raise BackendError(f"model '{self.spec.name}': {exc}") from exc
        response = pb.ExecuteResponse()
        offset = 0
        shm = tensor_shm.OWNER if request.shm_pids else None
        cut: dict[str, _OutputRows] = {}
        for i, (size, requested) in enumerate(
            zip(request.request_batch_sizes, request.requested, strict=True)
        ):
            names = list(requested.names) or [o.name for o in self.spec.outputs]
            per_request = response.results.add()
            to = (shm, shm.consumer(request, i)) if shm is not None else None
            for name in names:
                if name in scattered:  # already in the request's own shape
                    per_request.outputs.append(_tensor(name, scattered[name][i], self.spec, to=to))
                    continue
                rows = cut.get(name)
                if rows is None:
                    rows = cut[name] = _OutputRows(name, results[name], self.spec)
                rows.take_into(per_request.outputs, offset, size, to)
            offset += size
        t3 = time.monotonic_ns()
        response.compute_input_ns = t1 - t0
        response.compute_infer_ns = t2 - t1
        response.compute_output_ns = t3 - t2
        return response

    def close(self) -> None:
        self.session.close()

    def _on_device(self) -> DeviceBatches:
        """The in-place path of this instance (RegionNotLocal where it has
        none: the gateway resends the batch's bytes)."""
        if self._device is None:
            # imported here: a worker that never gets a CUDA reference never
            # imports the in-place path's modules
            from services.worker.device_batches import DeviceBatches

            self._device = DeviceBatches(self.spec, self.session, _tensor)
        return self._device

    def _batch_inputs(self, request: pb.ExecuteRequest) -> dict[str, np.ndarray]:
        """Triton's batch_input tensors, computed from the formed batch."""
        feeds: dict[str, np.ndarray] = {}
        for spec in self.spec.batch_inputs:
            shapes = request_shapes(request, self.spec, spec.source_input)
            arr = batch_input_array(spec, shapes)
            feeds.update(dict.fromkeys(spec.target_names, arr))
        return feeds

    def _scatter(
        self, request: pb.ExecuteRequest, results: dict[str, np.ndarray]
    ) -> dict[str, list[np.ndarray]]:
        """BATCH_SCATTER_WITH_INPUT_SHAPE outputs, cut into per-request pieces."""
        out: dict[str, list[np.ndarray]] = {}
        for spec in self.spec.batch_outputs:
            sources = request_shapes(request, self.spec, spec.source_input)
            for name in spec.target_names:
                declared = self.spec.output(name)
                if name not in results or declared is None:
                    continue  # not requested by this batch
                dims = (-1, *declared.dims)  # batch outputs need batching (config.py)
                out[name] = scatter(results[name], scatter_shapes(dims, sources))
        return out

    def _wanted_outputs(self, request: pb.ExecuteRequest) -> list[str]:
        """Union of what the batch's requests asked for (state outputs included)."""
        wanted: dict[str, None] = {}
        for requested in request.requested:
            names = requested.names or [o.name for o in self.spec.outputs]
            wanted.update(dict.fromkeys(names))
        return list(wanted)


class _OutputRows:
    """One output of a batch, cut into its requests' tensors. What every row
    shares (the config's shape and datatype, byte order) is settled once per
    batch, not per row. `execute_batch` alone on a 4-row batch of the
    example accumulator (6 outputs, 24 row tensors): 133-141 us of CPU
    settled per row, 108-113 us so (`simple`, 2 outputs: 58-60 and 50-51;
    2-core VM, docs/benchmarks.md "Per-row costs of a sequence batch")."""

    def __init__(self, name: str, arr: np.ndarray, spec: ModelSpec) -> None:
        self.name = name
        self.spec = spec
        self.whole = arr  # as the model gave it
        out = spec.output_tensor(name)
        assert out is not None
        dt = out.datatype
        self.datatype = dt.triton
        self.numeric = dt.triton not in ("BYTES", "BF16") and dt.numpy is not None
        if self.numeric:
            if out.reshape is not None:  # the model's shape -> the config's dims
                arr = arr.reshape(((arr.shape[0],) if spec.batching else ()) + out.dims)
            if arr.dtype != dt.numpy:
                arr = arr.astype(dt.numpy)
            if arr.dtype.byteorder == ">":
                arr = arr.astype(arr.dtype.newbyteorder("<"))
        self.arr = arr

    def take_into(
        self,
        outputs: Any,
        offset: int,
        size: int,
        to: tuple[tensor_shm.TensorShm, int] | None,
    ) -> None:
        """Add rows offset..offset+size (the whole output for a non-batching
        model) to a request's `outputs`, built in place (an appended message
        is a copy: ~0.6 us a row more)."""
        batching = self.spec.batching
        if not self.numeric:
            whole = self.whole[offset : offset + size] if batching else self.whole
            outputs.append(_tensor(self.name, whole, self.spec, size, to))
            return
        arr = self.arr[offset : offset + size] if batching else self.arr
        t = outputs.add(name=self.name, datatype=self.datatype, shape=arr.shape)
        if to is not None and to[1] and to[0].put_array(t, arr, to[1]):
            return
        t.raw = arr.tobytes()


def _tensor(
    name: str,
    arr: np.ndarray,
    spec: ModelSpec,
    batch: int | None = None,
    to: tuple[tensor_shm.TensorShm, int] | None = None,
) -> pb.Tensor:
    """One request's output; batch None: arr already has its final shape.
    `to`: this worker's region and the gateway pid to write a large output
    there for (pid 0: raw bytes)."""
    out = spec.output_tensor(name)
    assert out is not None
    if out.reshape is not None and batch is not None:  # the model's shape -> the config's dims
        arr = arr.reshape(((batch,) if spec.batching else ()) + out.dims)
    dt = out.datatype
    if dt.triton not in ("BYTES", "BF16") and dt.numpy is not None and arr.dtype != dt.numpy:
        arr = arr.astype(dt.numpy)
    t = pb.Tensor(name=name, datatype=dt.triton, shape=list(arr.shape))
    numeric = dt.triton not in ("BYTES", "BF16")
    if to is not None and to[1] and numeric and to[0].put_array(t, arr, to[1]):
        return t
    t.raw = numpy_to_raw(arr, from_triton(dt.triton))
    return t
