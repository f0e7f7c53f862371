"""services/worker/blas_threads.py: when the worker limits numpy's BLAS pool."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.worker.blas_threads import USER_THREAD_VARIABLES, blas_thread_limit


def test_the_configured_limit_applies_when_the_user_set_nothing() -> None:
    assert blas_thread_limit({}, 1) == 1
    assert blas_thread_limit({"PATH": "/bin"}, 4) == 4


@pytest.mark.parametrize("name", USER_THREAD_VARIABLES)
def test_a_thread_variable_the_user_set_wins(name: str) -> None:
    assert blas_thread_limit({name: "8"}, 1) is None


def test_an_empty_variable_is_not_a_choice() -> None:
    assert blas_thread_limit({"OPENBLAS_NUM_THREADS": ""}, 1) == 1


def test_zero_leaves_the_library_default() -> None:
    assert blas_thread_limit({}, 0) is None


def test_applying_the_limit_sets_numpys_blas_pool() -> None:
    # A fresh process: the limit is process-wide.
    code = (
        "import threadpoolctl\n"
        "from services.worker.blas_threads import limit_blas_threads\n"
        "assert limit_blas_threads({}, 1) == 1\n"
        "pools = [p['num_threads'] for p in threadpoolctl.threadpool_info()"
        " if p['user_api'] == 'blas']\n"
        "print(pools)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[1]"
