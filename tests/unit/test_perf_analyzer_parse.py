"""Parsing of perf_analyzer (tritonclient 2.50.0) reports, on captured real output.

The samples below are verbatim captures (trailing spaces stripped; long lines are
split with a backslash-newline, which Python joins back) of:

* TRITON_*: perf_analyzer 2.50.0 against a real Triton server 2.51.0 (the
  ``tritonserver`` bundled in ``nvidia-pytriton==0.7.0``, CPU only), serving a
  Python-backend model ``double_fp32`` (FP32 [16], max_batch_size 8):
  ``-i grpc -u 127.0.0.1:18101 -m double_fp32 --concurrency-range 2:2 -p 2000 -s 20
  --verbose-csv -f F`` (AVG), the same at ``4:4`` with ``--percentile=95`` (P95),
  and ``--concurrency-range 1:3:2 -p 1500 -s 30`` (SWEEP).
* NOSTATS_*: against a minimal gRPC server whose ServerMetadata lists no
  ``statistics`` extension (so perf_analyzer prints/writes no server columns),
  ``--percentile=99`` without ``--verbose-csv``.
* UNKNOWN_MODEL_OUTPUT (exit 99) and UNSTABLE_OUTPUT (exit 2, ``-s 1 -r 3``).
"""

from __future__ import annotations

import math
import os
import socket
import stat
import sys
import textwrap
import time
from concurrent import futures
from pathlib import Path

import pytest

from bench.perf_analyzer import (
    PerfAnalyzer,
    PerfAnalyzerError,
    PerfAnalyzerUnstable,
    PerfResult,
    ServerStats,
    build_result,
    find_perf_analyzer,
    format_table,
    parse_csv,
    parse_stdout,
    perf_args,
    run_perf,
    shape_args,
)

TRITON_AVG_STDOUT = """\
*** Measurement Settings ***
  Batch size: 1
  Service Kind: TRITON
  Using "time_windows" mode for stabilization
  Stabilizing using average latency and throughput
  Measurement window: 2000 msec
  Latency limit: 0 msec
  Concurrency limit: 2 concurrent requests
  Using synchronous calls for inference

Request concurrency: 2
  Client:
    Request count: 3989
    Throughput: 553.36 infer/sec
    Avg latency: 3609 usec (standard deviation 861 usec)
    p50 latency: 3542 usec
    p90 latency: 4342 usec
    p95 latency: 4658 usec
    p99 latency: 6489 usec
    Avg gRPC time: 3593 usec ((un)marshal request/response 5 usec + response wait 3588 usec)
  Server:
    Inference count: 3989
    Execution count: 3865
    Successful request count: 3989
    Avg request latency: 3419 usec (overhead 2 usec + queue 1578 usec + compute input 18\
 usec + compute infer 1655 usec + compute output 165 usec)

Inferences/Second vs. Client Average Batch Latency
Concurrency: 2, throughput: 553.36 infer/sec, latency 3609 usec
"""

TRITON_AVG_CSV = """\
Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,\
Server Compute Input,Server Compute Infer,Server Compute Output,Client Recv,p50 latency,\
p90 latency,p95 latency,p99 latency,Avg latency,request/response,response wait
2,553.36,4,185,1578,18,1655,165,1,3542,4342,4658,6489,3609,5,3588
"""

TRITON_P95_STDOUT = """\
*** Measurement Settings ***
  Batch size: 1
  Service Kind: TRITON
  Using "time_windows" mode for stabilization
  Stabilizing using p95latency and throughput
  Measurement window: 2000 msec
  Latency limit: 0 msec
  Concurrency limit: 4 concurrent requests
  Using synchronous calls for inference

Request concurrency: 4
  Client:
    Request count: 7899
    Throughput: 1094.37 infer/sec
    p50 latency: 3497 usec
    p90 latency: 4509 usec
    p95 latency: 4806 usec
    p99 latency: 6194 usec
    Avg gRPC time: 3637 usec ((un)marshal request/response 4 usec + response wait 3633 usec)
  Server:
    Inference count: 7899
    Execution count: 3912
    Successful request count: 7899
    Avg request latency: 3360 usec (overhead 3 usec + queue 1522 usec + compute input 30\
 usec + compute infer 1630 usec + compute output 175 usec)

Inferences/Second vs. Client p95 Batch Latency
Concurrency: 4, throughput: 1094.37 infer/sec, latency 4806 usec
"""

TRITON_P95_CSV = """\
Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,\
Server Compute Input,Server Compute Infer,Server Compute Output,Client Recv,p50 latency,\
p90 latency,p95 latency,p99 latency,request/response,response wait
4,1094.37,3,286,1522,30,1630,175,1,3497,4509,4806,6194,4,3633
"""

TRITON_SWEEP_STDOUT = """\
*** Measurement Settings ***
  Batch size: 1
  Service Kind: TRITON
  Using "time_windows" mode for stabilization
  Stabilizing using average latency and throughput
  Measurement window: 1500 msec
  Latency limit: 0 msec
  Concurrency limit: 3 concurrent requests
  Using synchronous calls for inference

Request concurrency: 1
  Client:
    Request count: 2761
    Throughput: 510.767 infer/sec
    Avg latency: 1953 usec (standard deviation 424 usec)
    p50 latency: 1856 usec
    p90 latency: 2392 usec
    p95 latency: 2636 usec
    p99 latency: 3745 usec
    Avg gRPC time: 1938 usec ((un)marshal request/response 4 usec + response wait 1934 usec)
  Server:
    Inference count: 2761
    Execution count: 2761
    Successful request count: 2761
    Avg request latency: 1774 usec (overhead 1 usec + queue 56 usec + compute input 15 usec\
 + compute infer 1566 usec + compute output 135 usec)

Request concurrency: 3
  Client:
    Request count: 4544
    Throughput: 839.53 infer/sec
    Avg latency: 3567 usec (standard deviation 848 usec)
    p50 latency: 3345 usec
    p90 latency: 4655 usec
    p95 latency: 5137 usec
    p99 latency: 6703 usec
    Avg gRPC time: 3553 usec ((un)marshal request/response 5 usec + response wait 3548 usec)
  Server:
    Inference count: 4544
    Execution count: 3013
    Successful request count: 4544
    Avg request latency: 3289 usec (overhead 2 usec + queue 1504 usec + compute input 26\
 usec + compute infer 1600 usec + compute output 157 usec)

Inferences/Second vs. Client Average Batch Latency
Concurrency: 1, throughput: 510.767 infer/sec, latency 1953 usec
Concurrency: 3, throughput: 839.53 infer/sec, latency 3567 usec
"""

TRITON_SWEEP_CSV = """\
Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,\
Server Compute Input,Server Compute Infer,Server Compute Output,Client Recv,p50 latency,\
p90 latency,p95 latency,p99 latency,Avg latency,request/response,response wait
1,510.767,3,174,56,15,1566,135,1,1856,2392,2636,3745,1953,4,1934
3,839.53,4,274,1504,26,1600,157,1,3345,4655,5137,6703,3567,5,3548
"""

NOSTATS_P99_STDOUT = """\
*** Measurement Settings ***
  Batch size: 1
  Service Kind: TRITON
  Using "time_windows" mode for stabilization
  Stabilizing using p99latency and throughput
  Measurement window: 1000 msec
  Latency limit: 0 msec
  Concurrency limit: 2 concurrent requests
  Using synchronous calls for inference

Request concurrency: 2
  Client:
    Request count: 5642
    Throughput: 1559.38 infer/sec
    p50 latency: 1258 usec
    p90 latency: 1427 usec
    p95 latency: 1492 usec
    p99 latency: 1718 usec
    Avg gRPC time: 1265 usec ((un)marshal request/response 4 usec + response wait 1261 usec)
Inferences/Second vs. Client p99 Batch Latency
Concurrency: 2, throughput: 1559.38 infer/sec, latency 1718 usec
"""

NOSTATS_P99_CSV = """\
Concurrency,Inferences/Second,Client Send,Client Recv,p50 latency,p90 latency,p95 latency,\
p99 latency
2,1559.38,3,1,1258,1427,1492,1718
"""

UNKNOWN_MODEL_OUTPUT = """\
error: failed to get model metadata: Request for unknown model: 'nosuch' is not found
"""

UNSTABLE_OUTPUT = """\
*** Measurement Settings ***
  Batch size: 1
  Service Kind: TRITON
  Using "time_windows" mode for stabilization
  Stabilizing using average latency and throughput
  Measurement window: 200 msec
  Latency limit: 0 msec
  Concurrency limit: 4 concurrent requests
  Using synchronous calls for inference

Request concurrency: 4
Failed to obtain stable measurement within 3 measurement windows for concurrency 4. Please\
 try to increase the --measurement-interval.
Failed to obtain stable measurement.
"""


# --------------------------------------------------------------------------- CSV


def test_parse_csv_triton_verbose_avg():
    rows = parse_csv(TRITON_AVG_CSV)
    assert rows == [
        {
            "Concurrency": 2,
            "Inferences/Second": 553.36,
            "Client Send": 4,
            "Network+Server Send/Recv": 185,
            "Server Queue": 1578,
            "Server Compute Input": 18,
            "Server Compute Infer": 1655,
            "Server Compute Output": 165,
            "Client Recv": 1,
            "p50 latency": 3542,
            "p90 latency": 4342,
            "p95 latency": 4658,
            "p99 latency": 6489,
            "Avg latency": 3609,
            "request/response": 5,
            "response wait": 3588,
        }
    ]


def test_parse_csv_percentile_mode_has_no_avg_column():
    (row,) = parse_csv(TRITON_P95_CSV)
    assert "Avg latency" not in row
    assert row["p95 latency"] == 4806
    assert row["response wait"] == 3633


def test_parse_csv_sweep_rows_and_crlf():
    rows = parse_csv(TRITON_SWEEP_CSV.replace("\n", "\r\n"))
    assert [r["Concurrency"] for r in rows] == [1, 3]
    assert [r["Inferences/Second"] for r in rows] == [510.767, 839.53]


def test_parse_csv_empty():
    assert parse_csv("") == []


# --------------------------------------------------------------------------- stdout


def test_parse_stdout_triton_avg():
    blocks = parse_stdout(TRITON_AVG_STDOUT)
    assert blocks == {
        2: {
            "request_count": 3989,
            "throughput": 553.36,
            "avg_us": 3609,
            "p50_us": 3542,
            "p90_us": 4342,
            "p95_us": 4658,
            "p99_us": 6489,
            "server_request_us": 3419,
            "server_queue_us": 1578,
            "server_compute_input_us": 18,
            "server_compute_infer_us": 1655,
            "server_compute_output_us": 165,
        }
    }


def test_parse_stdout_percentile_mode_has_no_avg():
    (block,) = parse_stdout(TRITON_P95_STDOUT).values()
    assert "avg_us" not in block
    assert block["throughput"] == 1094.37
    assert block["p99_us"] == 6194


def test_parse_stdout_sweep_keeps_blocks_apart():
    blocks = parse_stdout(TRITON_SWEEP_STDOUT)
    assert sorted(blocks) == [1, 3]
    assert blocks[1]["throughput"] == 510.767
    assert blocks[1]["server_queue_us"] == 56
    assert blocks[3]["throughput"] == 839.53
    assert blocks[3]["avg_us"] == 3567


def test_parse_stdout_tolerates_trailing_spaces():
    # The real tool prints "  Client: " / "  Server: " with a trailing space.
    spaced = "\n".join(line + "  " for line in TRITON_AVG_STDOUT.splitlines())
    assert parse_stdout(spaced) == parse_stdout(TRITON_AVG_STDOUT)


def test_parse_stdout_errors_have_no_blocks():
    assert parse_stdout(UNKNOWN_MODEL_OUTPUT) == {}
    # A block header with no numbers after it: build_result will not find a result.
    assert parse_stdout(UNSTABLE_OUTPUT) == {4: {}}


# --------------------------------------------------------------------------- PerfResult


def test_build_result_triton_avg():
    r = build_result("double_fp32", 2, TRITON_AVG_CSV, TRITON_AVG_STDOUT)
    assert r.model == "double_fp32"
    assert r.concurrency == 2
    assert r.throughput == pytest.approx(553.36)
    assert (r.p50_us, r.p90_us, r.p95_us, r.p99_us) == (3542, 4342, 4658, 6489)
    assert r.avg_us == 3609
    assert (r.client_send_us, r.client_recv_us) == (4, 1)
    assert r.request_count == 3989
    assert r.server == ServerStats(
        network_us=185, queue_us=1578, compute_input_us=18, compute_infer_us=1655,
        compute_output_us=165,
    )  # fmt: skip
    assert r.server.compute_us == 18 + 1655 + 165
    assert r.stdout == TRITON_AVG_STDOUT
    assert r.csv == TRITON_AVG_CSV


def test_build_result_percentile_mode_avg_is_none():
    r = build_result("double_fp32", 4, TRITON_P95_CSV, TRITON_P95_STDOUT)
    assert r.avg_us is None
    assert r.throughput == pytest.approx(1094.37)
    assert r.p95_us == 4806
    assert r.server is not None and r.server.queue_us == 1522


def test_build_result_picks_the_requested_concurrency():
    r1 = build_result("double_fp32", 1, TRITON_SWEEP_CSV, TRITON_SWEEP_STDOUT)
    r3 = build_result("double_fp32", 3, TRITON_SWEEP_CSV, TRITON_SWEEP_STDOUT)
    assert (r1.throughput, r1.p99_us, r1.request_count) == (510.767, 3745, 2761)
    assert (r3.throughput, r3.p99_us, r3.request_count) == (839.53, 6703, 4544)


def test_build_result_without_server_statistics():
    r = build_result("identity_fp32", 2, NOSTATS_P99_CSV, NOSTATS_P99_STDOUT)
    assert r.server is None
    assert r.avg_us is None
    assert (r.throughput, r.p50_us, r.p99_us) == (1559.38, 1258, 1718)
    assert r.request_count == 5642


def test_build_result_falls_back_to_stdout_without_csv():
    from_csv = build_result("double_fp32", 2, TRITON_AVG_CSV, TRITON_AVG_STDOUT)
    r = build_result("double_fp32", 2, "", TRITON_AVG_STDOUT)
    for name in ("throughput", "p50_us", "p90_us", "p95_us", "p99_us", "avg_us"):
        assert getattr(r, name) == getattr(from_csv, name), name
    assert r.server is not None
    assert r.server.queue_us == 1578
    assert r.server.compute_infer_us == 1655
    assert math.isnan(r.server.network_us)  # only the CSV has it


@pytest.mark.parametrize("stdout", [UNKNOWN_MODEL_OUTPUT, UNSTABLE_OUTPUT, TRITON_AVG_STDOUT])
def test_build_result_raises_when_nothing_matches(stdout):
    with pytest.raises(ValueError):
        build_result("m", 7, "", stdout)


# --------------------------------------------------------------------------- flags, table


def test_perf_args():
    assert perf_args("127.0.0.1:8001", "m", 4) == [
        "-i", "grpc", "-u", "127.0.0.1:8001", "-m", "m", "--concurrency-range", "4:4",
        "-p", "5000", "-s", "20", "--verbose-csv", "-f", "perf.csv",
    ]  # fmt: skip
    args = perf_args(
        "h:1", "m", 2, measurement_ms=1000, stability_pct=10, percentile=99,
        extra_args=["--async", "-b", "4"],
    )  # fmt: skip
    assert args[args.index("-p") + 1] == "1000"
    assert args[args.index("-s") + 1] == "10"
    assert "--percentile=99" in args
    assert args[-3:] == ["--async", "-b", "4"]


def test_perf_args_shapes():
    """One --shape per input, dims without the batch dimension (the CNN's [3, S, S])."""
    args = perf_args("h:1", "cnn", 8, shapes={"INPUT": (3, 32, 32)}, extra_args=["-v"])
    i = args.index("--shape")
    assert args[i + 1] == "INPUT:3,32,32"
    assert args[-1] == "-v" and args.count("--shape") == 1
    two = perf_args("h:1", "m", 1, shapes={"A": [16], "B": (2, 3)})
    assert [two[j + 1] for j, a in enumerate(two) if a == "--shape"] == ["A:16", "B:2,3"]
    assert "--shape" not in perf_args("h:1", "m", 1, shapes={})
    assert shape_args({}) == []
    for bad in ({"A": ()}, {"A": (3, -1)}, {"A": (0,)}):
        with pytest.raises(ValueError, match="--shape A"):
            shape_args(bad)


def test_format_table():
    rows = [
        build_result("double_fp32", 1, TRITON_SWEEP_CSV, TRITON_SWEEP_STDOUT),
        build_result("identity_fp32", 2, NOSTATS_P99_CSV, NOSTATS_P99_STDOUT),
    ]
    table = format_table(rows)
    lines = table.splitlines()
    assert len(lines) == 4
    assert lines[0].split() == [
        "model", "conc", "infer/s", "avg_us", "p50_us", "p90_us", "p99_us", "queue_us",
        "compute_us",
    ]  # fmt: skip
    assert len({len(line) for line in lines}) == 1  # aligned
    assert lines[2].split() == [
        "double_fp32", "1", "510.8", "1,953", "1,856", "2,392", "3,745", "56", "1,716",
    ]  # fmt: skip
    # No avg (percentile mode) and no server stats render as "-".
    assert lines[3].split() == [
        "identity_fp32", "2", "1,559.4", "-", "1,258", "1,427", "1,718", "-", "-",
    ]  # fmt: skip
    assert format_table([]).splitlines()[0].startswith("model")


# --------------------------------------------------------------------------- find / run


def _fake_venv(root: Path, with_cudart: bool = True) -> Path:
    binary = root / "bin" / "perf_analyzer"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    site = root / "lib" / "python3.11" / "site-packages"
    (site / "tritonclient-2.50.0.dist-info").mkdir(parents=True)
    if with_cudart:
        lib = site / "nvidia" / "cuda_runtime" / "lib"
        lib.mkdir(parents=True)
        (lib / "libcudart.so.12").write_bytes(b"")
    return root


def test_find_perf_analyzer_in_venv(tmp_path, monkeypatch):
    monkeypatch.delenv("PERF_ANALYZER", raising=False)
    venv = _fake_venv(tmp_path / "venv")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/other")
    pa = find_perf_analyzer(venv)
    assert pa is not None
    lib = venv / "lib/python3.11/site-packages/nvidia/cuda_runtime/lib"
    assert pa.binary == venv / "bin" / "perf_analyzer"
    assert pa.lib_dir == lib
    assert pa.env["LD_LIBRARY_PATH"] == f"{lib}:/opt/other"
    assert pa.tritonclient_version == "2.50.0"
    # PERF_VENV is honoured when no venv is passed.
    monkeypatch.setenv("PERF_VENV", str(venv))
    again = find_perf_analyzer()
    assert again is not None
    assert (again.binary, again.lib_dir) == (pa.binary, pa.lib_dir)


def test_find_perf_analyzer_needs_cudart(tmp_path, monkeypatch):
    monkeypatch.delenv("PERF_ANALYZER", raising=False)
    venv = _fake_venv(tmp_path / "venv", with_cudart=False)
    assert find_perf_analyzer(venv) is None
    assert find_perf_analyzer(tmp_path / "missing") is None
    # PATH is not searched (the main env's older perf_analyzer lives there).
    monkeypatch.setenv("PATH", str(venv / "bin"))
    monkeypatch.setenv("PERF_VENV", str(tmp_path / "missing"))
    assert find_perf_analyzer() is None


def test_find_perf_analyzer_explicit_binary(tmp_path, monkeypatch):
    venv = _fake_venv(tmp_path / "venv")
    monkeypatch.setenv("PERF_VENV", str(tmp_path / "missing"))
    monkeypatch.setenv("PERF_ANALYZER", str(venv / "bin" / "perf_analyzer"))
    pa = find_perf_analyzer()
    assert pa is not None
    assert pa.binary == venv / "bin" / "perf_analyzer"
    assert pa.lib_dir == venv / "lib/python3.11/site-packages/nvidia/cuda_runtime/lib"
    assert pa.env["LD_LIBRARY_PATH"].startswith(str(pa.lib_dir))
    monkeypatch.setenv("PERF_ANALYZER", str(tmp_path / "nope"))
    assert find_perf_analyzer() is None


FAKE_TOOL = textwrap.dedent(
    """\
    #!/bin/sh
    # Stand-in for perf_analyzer: writes $FAKE_CSV to the -f file, prints $FAKE_OUT.
    out=""
    while [ $# -gt 0 ]; do
      if [ "$1" = "-f" ]; then out="$2"; fi
      shift
    done
    # exec, so that the timeout kill hits the sleeping process itself.
    [ -n "$FAKE_SLEEP" ] && exec sleep "$FAKE_SLEEP"
    cat "$FAKE_OUT"
    if [ "$FAKE_RC" = 0 ] && [ -n "$out" ]; then cp "$FAKE_CSV" "$out"; fi
    exit "$FAKE_RC"
    """
)


def _fake_tool(
    tmp_path: Path, stdout: str, csv_text: str, rc: int, sleep: str = ""
) -> PerfAnalyzer:
    tool = tmp_path / "perf_analyzer"
    tool.write_text(FAKE_TOOL)
    tool.chmod(0o755)
    (tmp_path / "out.txt").write_text(stdout)
    (tmp_path / "out.csv").write_text(csv_text)
    env = dict(os.environ)
    env.update(
        FAKE_OUT=str(tmp_path / "out.txt"), FAKE_CSV=str(tmp_path / "out.csv"),
        FAKE_RC=str(rc), FAKE_SLEEP=sleep,
    )  # fmt: skip
    return PerfAnalyzer(tool, env)


def test_run_perf_with_fake_tool(tmp_path):
    pa = _fake_tool(tmp_path, TRITON_AVG_STDOUT, TRITON_AVG_CSV, 0)
    r = run_perf("127.0.0.1:1", "double_fp32", 2, analyzer=pa, timeout_s=30)
    assert r == build_result("double_fp32", 2, TRITON_AVG_CSV, TRITON_AVG_STDOUT)


def test_run_perf_failure_carries_output(tmp_path):
    pa = _fake_tool(tmp_path, UNKNOWN_MODEL_OUTPUT, "", 99)
    with pytest.raises(PerfAnalyzerError) as info:
        run_perf("127.0.0.1:1", "nosuch", 1, analyzer=pa, timeout_s=30)
    assert not isinstance(info.value, PerfAnalyzerUnstable)
    assert info.value.returncode == 99
    assert "unknown model: 'nosuch'" in str(info.value)
    assert "--concurrency-range 1:1" in str(info.value)


def test_run_perf_unstable(tmp_path):
    pa = _fake_tool(tmp_path, UNSTABLE_OUTPUT, "", 2)
    with pytest.raises(PerfAnalyzerUnstable, match="Failed to obtain stable measurement"):
        run_perf("127.0.0.1:1", "double_fp32", 4, analyzer=pa, timeout_s=30)


def test_run_perf_timeout(tmp_path):
    pa = _fake_tool(tmp_path, TRITON_AVG_STDOUT, TRITON_AVG_CSV, 0, sleep="5")
    with pytest.raises(PerfAnalyzerError, match="timed out") as info:
        run_perf("127.0.0.1:1", "double_fp32", 2, analyzer=pa, timeout_s=0.5)
    assert info.value.returncode is None


# --------------------------------------------------------------------------- real tool


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _TinyServer:
    """An in-process KServe gRPC server with one FP32 identity model of ``dims``.

    ``dims`` (without the batch dimension) go into ModelConfig and, after a
    -1 batch dimension, into ModelMetadata; every ModelInfer's input shape is
    kept in ``shapes``.
    """

    def __init__(self, name: str, dims: list[int]) -> None:
        grpc = pytest.importorskip("grpc")
        mc = pytest.importorskip("tritonclient.grpc.model_config_pb2")
        pb = pytest.importorskip("tritonclient.grpc.service_pb2")
        pbg = pytest.importorskip("tritonclient.grpc.service_pb2_grpc")
        self.name = name
        self.shapes: list[tuple[int, ...]] = []
        tiny = self

        # pbg is only known at run time (importorskip): no static base class
        class Servicer(pbg.GRPCInferenceServiceServicer):  # type: ignore[name-defined]
            def ServerLive(self, request, context):
                return pb.ServerLiveResponse(live=True)

            def ServerReady(self, request, context):
                return pb.ServerReadyResponse(ready=True)

            def ModelReady(self, request, context):
                return pb.ModelReadyResponse(ready=request.name == name)

            def ServerMetadata(self, request, context):
                return pb.ServerMetadataResponse(
                    name="tiny", version="0", extensions=["statistics"]
                )

            def ModelMetadata(self, request, context):
                if request.name != name:
                    context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model '{request.name}'")
                t = pb.ModelMetadataResponse.TensorMetadata
                return pb.ModelMetadataResponse(
                    name=name, versions=["1"], platform="python",
                    inputs=[t(name="INPUT0", datatype="FP32", shape=[-1, *dims])],
                    outputs=[t(name="OUTPUT0", datatype="FP32", shape=[-1, *dims])],
                )  # fmt: skip

            def ModelConfig(self, request, context):
                cfg = mc.ModelConfig(name=name, backend="python", max_batch_size=8)
                cfg.input.add(name="INPUT0", data_type=mc.TYPE_FP32, dims=dims)
                cfg.output.add(name="OUTPUT0", data_type=mc.TYPE_FP32, dims=dims)
                return pb.ModelConfigResponse(config=cfg)

            def ModelStatistics(self, request, context):
                n = len(tiny.shapes)
                st = pb.ModelStatistics(
                    name=name, version="1", inference_count=n, execution_count=n
                )
                for f in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
                    getattr(st.inference_stats, f).count = n
                    getattr(st.inference_stats, f).ns = n * 2000
                return pb.ModelStatisticsResponse(model_stats=[st])

            def ModelInfer(self, request, context):
                shape = list(request.inputs[0].shape)
                tiny.shapes.append(tuple(shape))
                resp = pb.ModelInferResponse(model_name=name, model_version="1", id=request.id)
                resp.outputs.add(name="OUTPUT0", datatype="FP32", shape=shape)
                resp.raw_output_contents.append(request.raw_input_contents[0])
                return resp

        port = _free_port()
        self.url = f"127.0.0.1:{port}"
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pbg.add_GRPCInferenceServiceServicer_to_server(Servicer(), self.server)
        self.server.add_insecure_port(self.url)

    def __enter__(self) -> _TinyServer:
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop(grace=None)


def _need_perf_analyzer() -> None:
    if find_perf_analyzer() is None:
        pytest.skip("perf_analyzer not installed (scripts/install_perf_analyzer.sh)")


@pytest.mark.perf
def test_run_perf_real_binary_against_tiny_server():
    """End to end: the installed perf_analyzer against an in-process KServe gRPC server."""
    _need_perf_analyzer()
    with _TinyServer("identity_fp32", [4]) as tiny:
        t0 = time.monotonic()
        r = run_perf(tiny.url, tiny.name, 1, measurement_ms=500, stability_pct=50,
                     timeout_s=60)  # fmt: skip
        assert isinstance(r, PerfResult)
        assert r.throughput > 0
        assert 0 < r.p50_us <= r.p90_us <= r.p99_us
        assert r.avg_us is not None and r.avg_us > 0
        assert r.server is not None and r.server.queue_us == 2
        assert r.request_count is not None and r.request_count > 0
        assert "Request concurrency: 1" in r.stdout
        assert time.monotonic() - t0 < 60

        with pytest.raises(PerfAnalyzerError, match="nosuch") as info:
            run_perf(tiny.url, "nosuch", 1, measurement_ms=500, timeout_s=60)
        assert info.value.returncode == 99


@pytest.mark.perf
@pytest.mark.parametrize("dims", [[3, 8, 8], [3, -1, -1]], ids=["fixed", "variable"])
def test_run_perf_sends_image_shaped_inputs(dims):
    """The benchmark CNN's [3, S, S] input: with ``shapes`` (``--shape INPUT0:3,8,8``)
    perf_analyzer sends [1, 3, 8, 8] whether the model's dims are fixed (the
    flag is accepted and ignored) or variable (the flag is what fills them)."""
    _need_perf_analyzer()
    with _TinyServer("image", dims) as tiny:
        r = run_perf(tiny.url, tiny.name, 1, measurement_ms=300, stability_pct=1000,
                     timeout_s=60, shapes={"INPUT0": (3, 8, 8)})  # fmt: skip
    assert r.throughput > 0
    assert set(tiny.shapes) == {(1, 3, 8, 8)}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
