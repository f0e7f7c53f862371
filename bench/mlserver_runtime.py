"""MLServer custom runtime that runs an ONNX file with ONNX Runtime.

Not imported by StageServe: :mod:`bench.references` copies this file into the
MLServer model repository it generates (as ``stageserve_bench_runtime.py``)
and names ``stageserve_bench_runtime.OnnxRuntimeModel`` as each model's
``implementation``. It runs inside ``.venv-mlserver``.

MLServer's adaptive batcher merges queued requests into one
``InferenceRequest`` (``max_batch_size`` / ``max_batch_time`` in
``model-settings.json``) before ``predict``; ``predict`` runs the whole batch
in one ``session.run`` on a single-thread executor, so the event loop keeps
serving gRPC while ONNX Runtime computes (ORT releases the GIL).

Session options match StageServe's worker: ``intra_op_threads`` (from
``parameters.extra``; default all cores) and no spin-waiting threads.
"""

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from mlserver.utils import get_model_uri


class OnnxRuntimeModel(MLModel):
    async def load(self) -> bool:
        path = await get_model_uri(self.settings, wellknown_filenames=["model.onnx"])
        extra = (self.settings.parameters.extra if self.settings.parameters else None) or {}
        threads = int(extra.get("intra_op_threads", 0)) or (os.cpu_count() or 1)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.log_severity_level = 3
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
        self._session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        self._output_names = [o.name for o in self._session.get_outputs()]
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ort")
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {inp.name: NumpyCodec.decode_input(inp) for inp in payload.inputs}
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(
            self._executor, self._session.run, self._output_names, feeds
        )
        return InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            outputs=[
                NumpyCodec.encode_output(name, value)
                for name, value in zip(self._output_names, results, strict=True)
            ],
        )

    async def unload(self) -> bool:
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=False)
        self._session = None
        return True
