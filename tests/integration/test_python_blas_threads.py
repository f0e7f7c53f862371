"""The worker limits numpy's BLAS threads for Python-backend models
(services/worker/blas_threads.py): one thread unless the user sized the pool,
seen from inside a model.py through tritonclient."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from stageserve_tools.examples import python_config_text, write_python_model
from tests.stack import running_stack

# THREADS: what numpy's BLAS pools report inside execute (the largest, if several).
BLAS_THREADS = """\
import numpy as np
import threadpoolctl
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        pools = [p["num_threads"] for p in threadpoolctl.threadpool_info()
                 if p["user_api"] == "blas"]
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            threads = np.full((x.shape[0], 1), max(pools, default=-1), dtype=np.int32)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("THREADS", threads)]))
        return out
"""


def _blas_threads_seen(repository: Path) -> int:
    with running_stack(repository) as stack:
        client = grpcclient.InferenceServerClient(stack.url)
        try:
            inp = grpcclient.InferInput("IN", [1, 4], "FP32")
            inp.set_data_from_numpy(np.zeros((1, 4), np.float32))
            return int(client.infer("blas", [inp]).as_numpy("THREADS")[0, 0])
        finally:
            client.close()


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    config = python_config_text(
        "blas", [("IN", "FP32", (4,))], [("THREADS", "INT32", (1,))], max_batch_size=8
    )
    write_python_model(tmp_path, "blas", BLAS_THREADS, config)
    return tmp_path


@pytest.fixture
def clean_thread_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS",
                 "BLIS_NUM_THREADS", "STAGESERVE_WORKER_BLAS_THREADS"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_models_numpy_uses_one_blas_thread_by_default(
    repository: Path, clean_thread_env: pytest.MonkeyPatch
) -> None:
    assert _blas_threads_seen(repository) == 1


def test_the_workers_setting_sizes_the_pool(
    repository: Path, clean_thread_env: pytest.MonkeyPatch
) -> None:
    clean_thread_env.setenv("STAGESERVE_WORKER_BLAS_THREADS", "3")
    assert _blas_threads_seen(repository) == 3


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS caps its pool at the cores")
def test_a_thread_variable_the_user_set_wins(
    repository: Path, clean_thread_env: pytest.MonkeyPatch
) -> None:
    # OpenBLAS takes at most one thread per core from its variable: 2, not our 1.
    clean_thread_env.setenv("OPENBLAS_NUM_THREADS", "2")
    assert _blas_threads_seen(repository) == 2
