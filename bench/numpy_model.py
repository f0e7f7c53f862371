"""Python-backend model whose ``execute`` does its work in numpy (issue 10's benchmark).

Not imported by StageServe: :mod:`bench.references` copies this file as
``<repository>/numpy/1/model.py`` next to ``weights.npz`` (the layers of
:func:`stageserve_tools.examples.mlp_weights` at :data:`bench.references.NUMPY_SIZES`)
for the servers that run Python-backend models: real Triton (in its stub
process) and StageServe (in the worker process). ONNX servers get the same
network as ONNX (``model.onnx``), so every server answers the same numbers.

``execute`` stacks every request of the dynamic batch and runs ONE forward
pass for the batch (Gemm + ReLU layers, softmax), as a user's numpy model
would. At the benchmark's sizes a batch of 1 takes about 1 ms of numpy on
this machine (the weights, 24 MB, are read once per batch), so the batch's
work, not the server, should set the pace.
"""

import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        path = os.path.join(args["model_repository"], args["model_version"], "weights.npz")
        with np.load(path) as weights:
            count = len(weights.files) // 2
            self.layers = [(weights[f"W{i}"], weights[f"B{i}"]) for i in range(count)]

    def execute(self, requests):
        parts = [pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() for r in requests]
        h = parts[0] if len(parts) == 1 else np.concatenate(parts)
        last = len(self.layers) - 1
        for i, (w, b) in enumerate(self.layers):
            h = h @ w
            h += b
            if i < last:
                np.maximum(h, 0.0, out=h)
        h -= h.max(axis=-1, keepdims=True)
        np.exp(h, out=h)
        h /= h.sum(axis=-1, keepdims=True)
        responses = []
        start = 0
        for part in parts:
            end = start + part.shape[0]
            out = pb_utils.Tensor("OUTPUT0", np.ascontiguousarray(h[start:end]))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            start = end
        return responses
