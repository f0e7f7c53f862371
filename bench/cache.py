"""Response cache: hit rate and latency on a repeated request set.

``python -m bench.cache`` starts a stack serving the ``mlp`` and ``cnn``
benchmark models with ``response_cache { enable: true }``, once per cache
(``--cache-config local,size=...`` and ``--cache-config redis``, the stack's
Redis), and sends, one at a time over gRPC, a set of distinct requests (each a
miss) and then the same set again ``--rounds`` times (each a hit). It prints
the p50 / p90 latency of misses and hits as the client sees them, the hit rate
the server's statistics report, and how many executions the model ran.
docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from bench.references import bench_model, stageserve_config_text, wait_ready
from stageserve.launcher import Stack, start_services
from stageserve_tools.examples import write_model

CACHE_LINE = "response_cache { enable: true }\n"
CACHES = {"local": ["--cache-config", "local,size=67108864"], "redis": ["--cache-config", "redis"]}


def _requests(model_name: str, distinct: int, seed: int = 7) -> list[list[grpcclient.InferInput]]:
    model = bench_model(model_name)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(distinct):
        inputs = []
        for name, dtype, dims in model.inputs:
            assert dtype == "FP32"
            x = rng.standard_normal((1, *dims)).astype(np.float32)
            i = grpcclient.InferInput(name, list(x.shape), dtype)
            i.set_data_from_numpy(x)
            inputs.append(i)
        out.append(inputs)
    return out


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3  # ms


def measure(cache: str, models: list[str], distinct: int, rounds: int) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in models:
            model = bench_model(name)
            write_model(root, name, model.onnx, stageserve_config_text(model) + CACHE_LINE)
        stack = Stack()
        try:
            services = start_services(
                stack, root, load_models=models, device="cpu", gateway_extra=CACHES[cache]
            )
            url = services.gateway.address
            wait_ready(url, models, 120)
            client = grpcclient.InferenceServerClient(url)
            for name in models:
                requests = _requests(name, distinct)
                client.infer(name, _requests(name, 1, seed=1)[0])  # warm: session, channels
                before = client.get_inference_statistics(name).model_stats[0]
                misses, hits = [], []
                for inputs in requests:
                    t = time.perf_counter()
                    client.infer(name, inputs)
                    misses.append(time.perf_counter() - t)
                for _ in range(rounds):
                    for inputs in requests:
                        t = time.perf_counter()
                        client.infer(name, inputs)
                        hits.append(time.perf_counter() - t)
                after = client.get_inference_statistics(name).model_stats[0]
                hit = after.inference_stats.cache_hit.count - before.inference_stats.cache_hit.count
                miss = (
                    after.inference_stats.cache_miss.count - before.inference_stats.cache_miss.count
                )
                results.append(
                    {
                        "cache": cache,
                        "model": name,
                        "requests": len(misses) + len(hits),
                        "hit_rate": round(hit / (hit + miss), 3),
                        "executions": after.execution_count - before.execution_count,
                        "miss_p50_ms": round(_pct(misses, 50), 3),
                        "miss_p90_ms": round(_pct(misses, 90), 3),
                        "hit_p50_ms": round(_pct(hits, 50), 3),
                        "hit_p90_ms": round(_pct(hits, 90), 3),
                        "hit_lookup_us": round(
                            (
                                after.inference_stats.cache_hit.ns
                                - before.inference_stats.cache_hit.ns
                            )
                            / max(hit, 1)
                            / 1e3,
                            1,
                        ),
                    }
                )
        finally:
            stack.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    p.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    p.add_argument("--distinct", type=int, default=100, help="distinct requests in the set")
    p.add_argument("--rounds", type=int, default=4, help="repeats of the set after the first")
    args = p.parse_args(argv)
    for cache in args.caches:
        for row in measure(cache, args.models, args.distinct, args.rounds):
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
