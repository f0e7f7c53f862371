"""`python -m bench.python_exec_env`: what a Python model's own execution
environment (EXECUTION_ENV_PATH) costs.

Builds a venv of this Python holding numpy 1.26.4 (pip into its
site-packages, byte-compiled, as a conda-pack archive carries .pyc files),
packs it as a gzip'd tar, then measures:

* unpack + check: EnvironmentManager.prepare() on the archive in a fresh
  manager (what a worker pays once per archive);
* stub start: a ProcessInstance of a model.py that imports numpy, from
  start to initialized, on the worker's own interpreter and packages and in
  the environment, alternately.

    python -m bench.python_exec_env --starts 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from services.worker.python_backend.process_instance import ProcessInstance
from stageserve.config import parse_config_text, to_spec
from stageserve.python_exec_env import EnvironmentManager, ExecutionEnv
from stageserve_tools.examples import python_config_text

MODEL = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return []
"""


def build_archive(folder: Path, numpy_version: str) -> Path:
    """A venv (no pip) with numpy_version, packed as <folder>/env.tar.gz."""
    env = folder / "env"
    site = env / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:",
         "--target", str(site / "site-packages"), f"numpy=={numpy_version}"],
        check=True,
    )  # fmt: skip
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(site)], check=True)
    archive = folder / "env.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(env, arcname=".")
    return archive


def _start_ms(model_file: Path, env: ExecutionEnv | None) -> float:
    spec = to_spec(
        parse_config_text(
            python_config_text("m", [("IN", "FP32", (2,))], [("O", "FP32", (2,))], max_batch_size=0)
        )
    )
    start = time.perf_counter()
    instance = ProcessInstance(
        model_file,
        spec,
        "{}",
        instance_name="m_0_0",
        kind="KIND_CPU",
        device_id=-1,
        version=1,
        execution_env=env,
    )
    elapsed = (time.perf_counter() - start) * 1000
    instance.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=5, help="stub starts per side")
    parser.add_argument("--numpy", default="1.26.4", help="numpy version in the environment")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_exec_env_"))
    archive = build_archive(work, args.numpy)
    print(f"archive: {archive.stat().st_size / 1e6:.1f} MB")
    unpacks = []
    for i in range(3):
        manager = EnvironmentManager(work / f"unpacked{i}")
        start = time.perf_counter()
        env = manager.prepare(str(archive))
        unpacks.append(time.perf_counter() - start)
    print("unpack + check s:", [round(s, 2) for s in unpacks])
    (work / "m" / "1").mkdir(parents=True)
    model_file = work / "m" / "1" / "model.py"
    model_file.write_text(MODEL)
    starts: dict[str, list[float]] = {"worker": [], "environment": []}
    for _ in range(args.starts):
        starts["worker"].append(_start_ms(model_file, None))
        starts["environment"].append(_start_ms(model_file, env))
    for side, values in starts.items():
        print(
            f"stub start on the {side}'s packages: median {statistics.median(values):.0f} ms",
            [round(v) for v in values],
        )


if __name__ == "__main__":
    main()
