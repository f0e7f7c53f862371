"""Which OpenBLAS kernels the Triton reference's numpy runs, and the fix when they are wrong.

The Triton reference (``.venv-triton``) needs numpy < 2; numpy 1.26.4 ships
OpenBLAS 0.3.23, which does not know every newer x86-64 CPU. On such a CPU
its DYNAMIC_ARCH falls back to the generic ``Prescott`` (SSE3) kernels. On a
2-vCPU VM reporting "Intel(R) Xeon(R) Processor" with AVX-512, the issue-10
numpy MLP (1024-2048-2048-16) took 10.8 ms per batch of 20 on one thread in
the Triton venv against 3.9 ms with StageServe's numpy 2.x (OpenBLAS 0.3.31),
4.9 ms with ``OPENBLAS_CORETYPE=SkylakeX``. Triton then serves the numpy
model at 0.3-0.6x its figures on a CPU OpenBLAS knows, which makes StageServe
look 1.4-1.8x faster for a reason that has nothing to do with either server.

So the benchmarks start tritonserver with ``OPENBLAS_CORETYPE`` set to the
kernels the CPU can run when its OpenBLAS reports the fallback, and say so;
a value the user set wins. StageServe's own numpy is not touched.
"""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Iterable
from pathlib import Path

#: What an OpenBLAS that did not recognise the CPU reports (DYNAMIC_ARCH's fallback).
FALLBACK_CORES = frozenset({"Prescott"})

#: (kernel name, CPU flags it needs), best first.
KERNELS: tuple[tuple[str, frozenset[str]], ...] = (
    ("SkylakeX", frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})),
    ("Haswell", frozenset({"avx2", "fma"})),
)

# Run with the reference venv's Python: its numpy's bundled OpenBLAS, asked
# for the kernels it chose (the symbol carries a suffix in 64-bit-int builds).
_QUERY = """
import ctypes, glob, os, numpy
here = os.path.dirname(numpy.__file__)
for path in glob.glob(os.path.join(here, os.pardir, "numpy.libs", "*openblas*")):
    lib = ctypes.CDLL(path)
    for name in ("openblas_get_corename64_", "openblas_get_corename"):
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype = ctypes.c_char_p
            print(fn().decode())
            raise SystemExit
"""


def coretype_for(corename: str | None, cpu_flags: Iterable[str]) -> str | None:
    """The OPENBLAS_CORETYPE to set: None unless OpenBLAS fell back to the
    generic kernels on a CPU that can run better ones."""
    if corename not in FALLBACK_CORES:
        return None
    flags = set(cpu_flags)
    return next((name for name, needs in KERNELS if needs <= flags), None)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


@functools.cache
def openblas_corename(python: Path) -> str | None:
    """The kernels the numpy of `python` runs; None if it cannot tell."""
    try:
        out = subprocess.run(
            [str(python), "-c", _QUERY], capture_output=True, text=True, timeout=60, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def reference_coretype(python: Path) -> str | None:
    """OPENBLAS_CORETYPE for a reference server whose Python is `python`, or None."""
    return coretype_for(openblas_corename(python), cpu_flags())
