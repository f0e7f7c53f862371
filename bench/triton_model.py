"""Triton Python-backend model that runs ``model.onnx`` with ONNX Runtime.

Not imported by StageServe: :mod:`bench.references` copies this file as
``<repository>/<model>/<version>/model.py`` next to the same ``model.onnx``
StageServe serves, for the real ``tritonserver`` (nvidia-pytriton's build has
no ONNX Runtime backend, only the Python one). It runs inside Triton's
``triton_python_backend_stub`` with the Python of ``.venv-triton``.

``execute`` gets every request of a dynamic batch at once: the inputs are
concatenated along the batch dimension, run through ONE ``session.run`` and the
outputs are split back per request, as Triton's ONNX Runtime backend does.

Session options match StageServe's worker: ``intra_op_thread_count`` (model
``parameters``; default cores // instances) and no spin-waiting threads.
"""

import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


def _parameter(config, key, default):
    value = config.get("parameters", {}).get(key, {}).get("string_value")
    return value if value else default


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        instances = sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1
        default_threads = max(1, (os.cpu_count() or 1) // instances)
        threads = int(_parameter(config, "intra_op_thread_count", default_threads))
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.log_severity_level = 3
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        self.session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        self.input_names = [t["name"] for t in config["input"]]
        self.output_names = [t["name"] for t in config["output"]]

    def execute(self, requests):
        columns = {name: [] for name in self.input_names}
        sizes = []
        for request in requests:
            for name in self.input_names:
                columns[name].append(pb_utils.get_input_tensor_by_name(request, name).as_numpy())
            sizes.append(columns[self.input_names[0]][-1].shape[0])
        feeds = {
            name: parts[0] if len(parts) == 1 else np.concatenate(parts)
            for name, parts in columns.items()
        }
        results = self.session.run(self.output_names, feeds)
        responses = []
        start = 0
        for size in sizes:
            tensors = [
                pb_utils.Tensor(name, np.ascontiguousarray(result[start : start + size]))
                for name, result in zip(self.output_names, results, strict=True)
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            start += size
        return responses

    def finalize(self):
        self.session = None
