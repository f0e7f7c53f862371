"""bench/profile.py: py-spy's collapsed stacks -> self time per frame and per area."""

from bench.profile import area_of, format_profile, is_idle, parse_collapsed

RAW = [
    "<module> (x.py:1);run_forever (asyncio/base_events.py:608);"
    "_run (grpc/_cython/cygrpc.pyx:10) 30\n",
    "<module> (x.py:1);infer (services/gateway/dataplane.py:120) 10\n",
    "<module> (x.py:1);infer (services/gateway/dataplane.py:120);"
    "SerializeToString (google/protobuf/message.py:5) 20\n",
    "<module> (x.py:1);run_forever (asyncio/base_events.py:608);select (selectors.py:468) 500\n",
    "_bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:81) 40\n",
    "\n",
    "garbage line without a count\n",
]


def test_self_samples_go_to_the_leaf_frame_and_its_area():
    profile = parse_collapsed(RAW, "gateway")
    assert profile.samples == 60
    assert profile.idle == 540  # the loop's epoll and an idle executor thread
    assert profile.self_frames["_run (grpc/_cython/cygrpc.pyx:10)"] == 30
    assert profile.self_frames["infer (services/gateway/dataplane.py:120)"] == 10
    assert profile.areas == {"grpc cython": 30, "protobuf": 20, "stageserve services": 10}
    assert profile.loop == 30  # on CPU under the event loop's run_forever; its epoll is idle


def test_area_of_unknown_file_is_other():
    assert area_of("f (/usr/lib/python3.11/threading.py:3)") == "other"
    assert area_of("f (services/scheduler/model_queue.py:9)") == "stageserve services"


def test_format_lists_areas_and_top_frames_as_shares():
    text = format_profile(parse_collapsed(RAW, "gateway"), top=2)
    assert text.splitlines()[0] == (
        "gateway: 60 samples on CPU (540 blocked in a wait, left out); the event loop's thread 50%"
    )
    assert "grpc cython 50%" in text
    assert "50.0%  _run (grpc/_cython/cygrpc.pyx:10)" in text
    assert "infer (services" not in text  # only the top 2 frames
    assert format_profile(parse_collapsed([], "worker")) == "worker: no samples"


def test_waits_are_idle_work_is_not():
    assert is_idle("EpollSelector.select (selectors.py:468)")
    assert is_idle("epoll_wait (libc.so.6)")
    assert is_idle("wait (threading.py:324)")
    assert not is_idle("select_batch (services/scheduler/batcher.py:3)")
    assert not is_idle("sendmsg (libc.so.6)")
    assert not is_idle("run (asyncio/runners.py:118)")
    assert is_idle("Runner.run (asyncio/runners.py:118)")  # uvloop's loop, in C


def test_under_uvloop_the_runner_marks_the_loop_thread_and_its_c_leaf_is_a_wait():
    runner = "<module> (x.py:1);run (asyncio/runners.py:190);Runner.run (asyncio/runners.py:118)"
    raw = [
        f"{runner} 400\n",
        f"{runner};data_received (stageserve/h2grpc/server.py:438) 30\n",
        "_bootstrap (threading.py:1002);run (bench/x.py:5) 10\n",
    ]
    profile = parse_collapsed(raw, "scheduler")
    assert (profile.samples, profile.idle, profile.loop) == (40, 400, 30)
