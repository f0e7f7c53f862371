"""bench/blas_coretype.py: the Triton reference's numpy gets the kernels this CPU
can run when its OpenBLAS falls back to the generic ones, and nothing else."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.blas_coretype import coretype_for, cpu_flags, openblas_corename
from bench.references import ReferenceNotInstalled, find_triton

AVX512 = {"sse3", "avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"}


@pytest.mark.parametrize(
    ("corename", "flags", "expected"),
    [
        ("Prescott", AVX512, "SkylakeX"),  # fell back on an AVX-512 CPU
        ("Prescott", {"sse3", "avx2", "fma"}, "Haswell"),
        ("Prescott", {"sse3", "avx2", "fma", "avx512f"}, "Haswell"),  # AVX-512 in part only
        ("Prescott", {"sse3"}, None),  # a CPU the generic kernels fit
        ("SkylakeX", AVX512, None),  # OpenBLAS knew the CPU: left alone
        ("Haswell", AVX512, None),
        (None, AVX512, None),  # could not tell
    ],
)
def test_only_the_fallback_is_corrected(corename, flags, expected) -> None:
    assert coretype_for(corename, flags) == expected


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse3 avx2 fma\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "sse3", "avx2", "fma"}
    assert cpu_flags(tmp_path / "missing") == set()


def test_the_triton_venvs_openblas_names_its_kernels() -> None:
    try:
        install = find_triton()
    except ReferenceNotInstalled as exc:
        pytest.skip(str(exc))
    name = openblas_corename(install.venv / "bin" / "python")
    assert name is not None and name.isidentifier()
    wanted = coretype_for(name, cpu_flags())
    env = install.env()
    if "OPENBLAS_CORETYPE" in os.environ:  # the user's choice wins
        assert env["OPENBLAS_CORETYPE"] == os.environ["OPENBLAS_CORETYPE"]
    else:
        assert env.get("OPENBLAS_CORETYPE") == wanted
