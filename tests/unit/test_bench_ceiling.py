"""bench.ceiling's servers answer a real ModelInfer with the input echoed (no perf_analyzer)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as triton

from bench import ceiling


def _infer(url: str, values: np.ndarray) -> np.ndarray:
    client = triton.InferenceServerClient(url)
    try:
        inp = triton.InferInput("INPUT0", list(values.shape), "FP32")
        inp.set_data_from_numpy(values)
        result = client.infer(
            ceiling.MODEL, [inp], outputs=[triton.InferRequestedOutput("OUTPUT0")]
        )
        out = result.as_numpy("OUTPUT0")
        assert out is not None
        return out
    finally:
        client.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "variant", ["forward", "relay", "h2-relay", "direct", "sync-direct", "sync-bridged"]
)
def test_variant_echoes_input(variant: str) -> None:
    values = np.arange(16, dtype=np.float32).reshape(1, 16) * 0.5 - 3.0
    running = ceiling.start(variant)
    pids = [p.pid for p in (running.front, running.middle, running.backend) if p is not None]
    assert len(pids) == {"forward": 2, "relay": 3, "h2-relay": 3}.get(variant, 1)
    try:
        np.testing.assert_array_equal(_infer(running.url, values), values)
        np.testing.assert_array_equal(_infer(running.url, values + 1), values + 1)
        requests, messages, forwarded = ceiling.read_counters(running.url)
        assert requests == 2
        if variant in ceiling.FORWARDING:
            assert messages >= 1 and forwarded == 2
        else:
            assert (messages, forwarded) == (0, 0)
    finally:
        ceiling.stop(running)
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _maps_uvloop(pid: int) -> bool:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return any("/uvloop/loop." in line for line in maps.splitlines())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_elements_size_the_model_and_the_loop_is_the_stacks(
    loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--elements sizes the model the servers announce and echo (49,152 bytes
    here); the asyncio servers run on the loop the stack's stages would."""
    monkeypatch.setenv(ceiling.ELEMENTS_ENV, "12288")
    monkeypatch.setenv("STAGESERVE_STACK_EVENT_LOOP", loop)
    values = np.random.default_rng(7).standard_normal((1, 12288)).astype(np.float32)
    running = ceiling.start("h2-direct")
    try:
        np.testing.assert_array_equal(_infer(running.url, values), values)
        client = triton.InferenceServerClient(running.url)
        try:
            config = client.get_model_config(ceiling.MODEL).config
        finally:
            client.close()
        assert list(config.input[0].dims) == [12288]
        assert _maps_uvloop(running.front.pid) == (loop == "uvloop")
    finally:
        ceiling.stop(running)


def test_loop_bridge_answers_every_thread_and_passes_errors() -> None:
    """Requests from many threads at once each get their own answer (the loop
    is woken per burst, not per request); an answer that raises raises in
    its caller's thread and the bridge goes on."""
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    bridge = ceiling.LoopBridge(loop)

    async def double(x: int) -> int:
        await asyncio.sleep(0)
        if x < 0:
            raise ValueError(x)
        return 2 * x

    try:
        with ThreadPoolExecutor(max_workers=16) as pool:
            results = list(pool.map(lambda x: bridge.call(double, x), range(500)))
        assert results == [2 * x for x in range(500)]
        with pytest.raises(ValueError):
            bridge.call(double, -1)
        assert bridge.call(double, 21) == 42
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()
