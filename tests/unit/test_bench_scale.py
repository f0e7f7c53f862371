"""bench.scale's own measurements: requests per stream message, read from a
stage's real /metrics, and the cores perf_analyzer used."""

from __future__ import annotations

from bench import scale
from stageserve.telemetry import STREAM_MESSAGES, STREAM_REQUESTS, serve_metrics


def test_requests_per_message_come_from_the_stream_counters_of_every_stage() -> None:
    server = serve_metrics(0, "127.0.0.1")
    try:
        port = server.server_address[1]
        before = scale.stream_counts([port])
        STREAM_MESSAGES.labels("bench-scale-test").inc(4)
        STREAM_REQUESTS.labels("bench-scale-test").inc(18)
        # the same process listed twice: two stages' counts are summed
        after = scale.stream_counts([port, port])
    finally:
        server.shutdown()
        server.server_close()
    m0, r0 = before.get("bench-scale-test", (0.0, 0.0))
    m1, r1 = after["bench-scale-test"]
    assert (m1 - 2 * m0, r1 - 2 * r0) == (8.0, 36.0)
    assert scale.per_message({"x": (10.0, 40.0)}, {"x": (14.0, 58.0)}) == {"x": 4.5}
    # a link that wrote nothing in between has no ratio
    assert scale.per_message({"x": (10.0, 40.0)}, {"x": (10.0, 40.0)}) == {}


def test_the_clients_cpu_is_what_its_ended_children_used() -> None:
    import subprocess
    import sys

    from bench.scale import Point, format_points, reaped_children_cpu

    before = reaped_children_cpu()
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)
    assert reaped_children_cpu() - before >= 0.3

    point = Point(
        "identity", 8, "grpc", 1000.0, 1.0, 2.0, 1.5, 4.0, True, client_cores=0.75,
        sched_loop_cores=0.93, sched_lag_p99_ms=2.0,
    )  # fmt: skip
    head, row = format_points([point]).splitlines()
    assert head.split()[-9:] == [
        "pa",
        "cores",
        "sched",
        "loop",
        "cores",
        "sched",
        "lag",
        "p99",
        "ms",
    ]
    assert row.split()[-3:] == ["0.75", "0.93", "<=2"]


def test_the_lag_quantile_is_the_bucket_bound_that_holds_it() -> None:
    from bench.scale import quantile_bound

    inf = float("inf")
    before = {0.001: 10.0, 0.002: 10.0, 0.005: 10.0, inf: 10.0}
    # 100 more observations: 90 under 1 ms, 9 in (1, 2] ms, 1 in (2, 5] ms
    after = {0.001: 100.0, 0.002: 109.0, 0.005: 110.0, inf: 110.0}
    assert quantile_bound(before, after, 0.5) == 0.001
    assert quantile_bound(before, after, 0.99) == 0.002
    assert quantile_bound(before, after, 1.0) == 0.005
    assert quantile_bound(after, after, 0.99) is None  # nothing observed in between
    assert quantile_bound({}, {0.001: 0.0, inf: 3.0}, 0.99) == inf  # beyond the last bound


def test_a_main_thread_counts_its_own_cpu_not_its_other_threads() -> None:
    import os
    import threading
    import time

    from bench.scale import main_thread_cpu

    def burn(seconds: float) -> None:
        start = time.thread_time()
        while time.thread_time() - start < seconds:
            pass

    pid = os.getpid()
    before, process_before = main_thread_cpu(pid), time.process_time()
    other = threading.Thread(target=burn, args=(0.4,))
    other.start()
    other.join()
    assert time.process_time() - process_before >= 0.4
    assert main_thread_cpu(pid) - before < 0.2  # the other thread's CPU is not the main one's
    before = main_thread_cpu(pid)
    burn(0.3)
    assert main_thread_cpu(pid) - before >= 0.25  # clock ticks: 10 ms each
    assert main_thread_cpu(2**22 + 12345) == 0.0  # no such process
