"""How many threads numpy's BLAS may use in a worker process.

Python-backend models run in the worker's process (docs/python_backend.md),
so a `model.py` doing numpy shares the worker's BLAS library. OpenBLAS, as
numpy ships it, starts one thread per core and its idle threads busy-wait
(sched_yield) for a while after every call; on a host that also runs the
gateway, scheduler and rate limiter those spinning threads take the cores the
stages need to move requests. Measured with bench.compare's `numpy` model
(an MLP whose model.py does ~1 ms of numpy per batch), StageServe serving
Triton's model.py on the 2-core dev machine, perf_analyzer over gRPC,
OpenBLAS default (2 threads) vs 1 thread, two interleaved rounds, infer/s:

    c=1 367/348 -> 310/312, c=8 735/695 -> 788/731,
    c=32 1,087/1,020 -> 1,446/1,444, c=64 1,144/1,137 -> 1,709/1,687

The instance is busy 73-77% of the time at c>=8 with one thread, 48-59%
with two: spinning threads slow the stages that feed it. One thread loses
~13% at c=1, where the cores are otherwise idle. (A first, noisier run gave
the same picture; OPENBLAS_THREAD_TIMEOUT=4, which makes idle threads sleep
at once instead, did not help there: 241 / 461 / 319 / 672 against
222 / 413 / 769 / 945 with the default.) So the worker
limits numpy's BLAS to one thread by default -- instances, not BLAS threads,
are the unit of parallelism, as for Ray Serve replicas (OMP_NUM_THREADS=1) --
unless the user chose: any of the usual thread variables set in the worker's
environment, or STAGESERVE_WORKER_BLAS_THREADS (0 keeps the library's own
default). Beyond Triton, whose Python stub leaves BLAS at its default.

The ONNX Runtime and TorchScript backends size their own thread pools
(intra-op threads split between instances) and are not affected: the limit
applies to the BLAS libraries numpy loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

log = logging.getLogger(__name__)

#: Environment variables through which a user already sized the BLAS pool.
USER_THREAD_VARIABLES = (
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OMP_NUM_THREADS",
    "BLIS_NUM_THREADS",
)


def blas_thread_limit(env: Mapping[str, str], configured: int) -> int | None:
    """The limit to apply, or None to leave BLAS as it is.

    `configured` is WorkerSettings.blas_threads (0: leave the library alone).
    A thread variable the user set wins over our default.
    """
    if configured <= 0:
        return None
    if any(env.get(name) for name in USER_THREAD_VARIABLES):
        return None
    return configured


def limit_blas_threads(env: Mapping[str, str], configured: int) -> int | None:
    """Apply :func:`blas_thread_limit` to the BLAS libraries loaded now (numpy's).

    Call once at worker start, before any model runs: changing a BLAS pool
    while another thread is inside a BLAS call is not safe.
    """
    limit = blas_thread_limit(env, configured)
    if limit is None:
        return None
    import numpy  # noqa: F401  (loads its BLAS, so threadpoolctl can find it)
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=limit, user_api="blas")
    log.info("numpy BLAS threads limited", extra={"threads": limit})
    return limit
