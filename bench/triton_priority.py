"""Rate-limiter priorities, real Triton 2.51 against StageServe: pick counts.

One Python-backend model, ``prio``, has two instance groups of one CPU
instance each, ``p1`` (priority 1) and ``p4`` (priority 4), both needing the
rate_limiter resource ``R`` (count 1, per device: the two instances share
the CPU's one). Every execution sleeps a few ms and answers the name of the
instance that ran it (``args['model_instance_name']``). With
``--rate-limit=execution_count`` and more clients than instances, both
instances always have work, so every pick of R is contended; the ratio of
p1's executions to p4's is what each server's priority rule gives.

    python -m bench.triton_priority [--seconds 4] [--clients 8] [--server both]

tests/integration/test_rate_limiter_triton.py runs the same measurement.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from bench.references import ReferenceNotInstalled, start_grpc_triton, stop_process, wait_ready

MODEL = "prio"
DELAY_MS = 5
#: the two layouts: one model with two instance groups, or two models of one
#: group each (priorities weighed across models; R is global there)
LAYOUTS = ("groups", "models")


def _group(priority: int, scope: str) -> str:
    return (
        f'{{ name: "p{priority}" count: 1 kind: KIND_CPU rate_limiter {{\n'
        f'   resources [ {{ name: "R" count: 1{scope} }} ] priority: {priority} }} }}'
    )


def config(name: str, groups: list[str]) -> str:
    return f"""
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "INSTANCE" data_type: TYPE_STRING dims: [ 1 ] }} ]
instance_group [ {", ".join(groups)} ]
parameters {{ key: "delay_ms" value {{ string_value: "{DELAY_MS}" }} }}
"""


MODEL_PY = """
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_instance_name"]
        params = json.loads(args["model_config"])["parameters"]
        self.delay_s = float(params["delay_ms"]["string_value"]) / 1000

    def execute(self, requests):
        time.sleep(self.delay_s)
        name = np.array([self.name.encode()], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("INSTANCE", name)]) for _ in requests]
"""


def models(layout: str) -> list[str]:
    """The models the clients send to (spread evenly)."""
    return [MODEL] if layout == "groups" else [f"{MODEL}_p1", f"{MODEL}_p4"]


def write_repository(root: Path, layout: str = "groups") -> Path:
    if layout == "groups":
        configs = {MODEL: config(MODEL, [_group(1, ""), _group(4, "")])}
    else:
        configs = {
            f"{MODEL}_p{p}": config(f"{MODEL}_p{p}", [_group(p, " global: true")]) for p in (1, 4)
        }
    for name, text in configs.items():
        (root / name / "1").mkdir(parents=True, exist_ok=True)
        (root / name / "config.pbtxt").write_text(text)
        (root / name / "1" / "model.py").write_text(MODEL_PY)
    return root


def picks(
    url: str, seconds: float, clients: int, layout: str = "groups", warmup_s: float = 1.0
) -> Counter[str]:
    """Executions per instance name while `clients` threads infer back to back
    for `seconds` (after `warmup_s` of the same load, not counted)."""
    names = models(layout)
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    counting = threading.Event()
    stop = threading.Event()
    errors: list[BaseException] = []

    def load(model: str) -> None:
        c = grpcclient.InferenceServerClient(url)
        inp = grpcclient.InferInput("IN", [1], "INT32")
        inp.set_data_from_numpy(np.zeros(1, dtype=np.int32))
        try:
            while not stop.is_set():
                name = c.infer(model, [inp]).as_numpy("INSTANCE")[0].decode()
                if counting.is_set() and not stop.is_set():
                    with lock:
                        counts[name] += 1
        except BaseException as exc:
            errors.append(exc)
        finally:
            c.close()

    threads = [
        threading.Thread(target=load, args=(names[i % len(names)],), daemon=True)
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    time.sleep(warmup_s)
    counting.set()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return counts


def ratio(counts: Counter[str]) -> float:
    """p1's executions per p4 execution."""
    return counts["p1_0"] / max(1, counts["p4_0"])


class TritonServer:
    """tritonserver --rate-limit=execution_count on the `prio` repository."""

    def __init__(self, workdir: Path, layout: str = "groups") -> None:
        repo = write_repository(workdir / "triton_repo", layout)
        self.proc, self.url = start_grpc_triton(
            workdir, repo, models(layout), ["--rate-limit", "execution_count"], 120
        )

    def stop(self) -> None:
        stop_process(self.proc)


class StageServeServer:
    def __init__(self, workdir: Path, layout: str = "groups") -> None:
        from stageserve.launcher import Stack, start_services

        repo = write_repository(workdir / "stageserve_repo", layout)
        self.stack = Stack()
        try:
            s = start_services(
                self.stack,
                repo,
                device="cpu",
                ratelimiter_args=["--rate-limit", "execution_count"],
                http_address=None,
            )
            self.url = s.gateway.address
            wait_ready(self.url, models(layout), 120)
        except BaseException:
            self.stack.stop()
            raise

    def stop(self) -> None:
        self.stack.stop()


def measure(server: str, seconds: float, clients: int, layout: str) -> Counter[str]:
    with tempfile.TemporaryDirectory(prefix="prio-") as tmp:
        started = time.monotonic()
        running = (TritonServer if server == "triton" else StageServeServer)(Path(tmp), layout)
        ready_s = time.monotonic() - started
        try:
            counts = picks(running.url, seconds, clients, layout)
        finally:
            running.stop()
        print(
            f"{server:<10} {layout:<6} ready in {ready_s:4.1f} s"
            f"  picks {dict(sorted(counts.items()))}  p1/p4 {ratio(counts):.2f}",
            flush=True,
        )
        return counts


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--server", choices=["triton", "stageserve", "both"], default="both")
    ap.add_argument("--layout", choices=[*LAYOUTS, "both"], default="both")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(argv)
    servers = ["triton", "stageserve"] if args.server == "both" else [args.server]
    layouts = LAYOUTS if args.layout == "both" else [args.layout]
    for _ in range(args.rounds):
        for layout in layouts:
            for server in servers:
                try:
                    measure(server, args.seconds, args.clients, layout)
                except ReferenceNotInstalled as exc:
                    print(f"{server}: {exc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
