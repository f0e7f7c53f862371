"""A decoupled BLS call streams into its caller (no stack): the iterator
(bls_wire.ResponseIterator), the worker's BLS client feeding it from its loop
(bls.py, with a fake scheduler link), and a model.py in a stub process
(process_instance.py / stub.py, with a fake BLS client in the worker)."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from services.worker.python_backend import pb_utils
from services.worker.python_backend.bls import BlsClient
from services.worker.python_backend.bls_wire import ResponseFeed, ResponseIterator
from services.worker.python_backend.process_instance import ProcessInstance
from services.worker.python_backend.stub import _BlsProxy
from services.worker.python_backend.stub_wire import StubSocket
from stageserve.config import parse_config_text, to_spec
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensors import numpy_to_raw, raw_to_numpy
from stageserve_tools.examples import python_config_text

GAP_S = 0.3


def _response(value: int) -> pb_utils.InferenceResponse:
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], np.int32))])


def _value(response: pb_utils.InferenceResponse) -> int | None:
    out = pb_utils.get_output_tensor_by_name(response, "OUT")
    return None if out is None else int(out.as_numpy()[0])


def _later(feed: ResponseFeed, *steps) -> threading.Thread:
    """Feeds (delay_s, value or None for the final flag alone) from a thread."""

    def run() -> None:
        for i, (delay, value) in enumerate(steps):
            time.sleep(delay)
            last = i == len(steps) - 1
            feed.put(pb_utils.InferenceResponse([]) if value is None else _response(value), last)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# ------------------------------------------------------------ the iterator


def test_iterator_yields_each_response_as_it_comes() -> None:
    """Ordered by events, not timed: the second response is fed only once the
    caller has the first (or after 10 s, if wait_first waited for more)."""
    feed = ResponseFeed()
    first_fed, caller_has_first = threading.Event(), threading.Event()
    fed_second = threading.Event()

    def feeder() -> None:
        time.sleep(GAP_S)
        feed.put(_response(0))
        first_fed.set()
        caller_has_first.wait(10)
        feed.put(_response(1))
        fed_second.set()
        feed.put(pb_utils.InferenceResponse([]), last=True)

    threading.Thread(target=feeder, daemon=True).start()
    responses = ResponseIterator(feed).wait_first()  # exec() returns with the first
    assert first_fed.is_set()  # not before the first response
    assert _value(next(responses)) == 0
    assert not fed_second.is_set()  # nor with the second
    caller_has_first.set()
    # the final flag alone: an empty response
    assert [_value(r) for r in responses] == [1, None]
    assert responses.finished


def test_iterator_restarts_once_finished_and_resumes_otherwise() -> None:
    """As Triton 2.51's (checked): a second `for` over a finished iterator
    yields every response again; next() on it stops; a partly read one resumes."""
    feed = ResponseFeed()
    for v in (0, 1):
        feed.put(_response(v))
    feed.put(_response(2), last=True)  # the final flag with the last response
    responses = ResponseIterator(feed)
    assert _value(next(responses)) == 0
    assert [_value(r) for r in responses] == [1, 2]  # resumed
    with pytest.raises(StopIteration):
        next(responses)
    assert [_value(r) for r in responses] == [0, 1, 2]  # again from the start


def test_iterator_raises_what_the_call_raised() -> None:
    feed = ResponseFeed()
    feed.fail(pb_utils.TritonModelException("no client"))
    with pytest.raises(pb_utils.TritonModelException, match="no client"):
        ResponseIterator(feed).wait_first()  # exec() raises it
    feed = ResponseFeed()
    feed.put(_response(0))
    feed.fail(ValueError("mid-stream"))
    responses = ResponseIterator(feed).wait_first()
    assert _value(next(responses)) == 0
    with pytest.raises(ValueError, match="mid-stream"):
        next(responses)
    with pytest.raises(StopIteration):
        next(responses)
    feed = ResponseFeed()
    feed.end()  # no response at all
    assert list(ResponseIterator(feed).wait_first()) == []


def test_an_iterator_dropped_early_drops_what_still_comes() -> None:
    feed = ResponseFeed()
    feed.put(_response(0))
    responses = ResponseIterator(feed).wait_first()
    assert _value(next(responses)) == 0
    feed.put(_response(1))
    del responses
    gc.collect()
    assert feed.abandoned
    for v in range(2, 100):
        feed.put(_response(v))  # never blocks, keeps nothing
    feed.put(_response(100), last=True)
    assert feed._queue.empty()


def test_wait_first_async_never_blocks_its_loop() -> None:
    """The first response is fed only once the caller's loop has ticked 5
    times while awaiting it (10 s at most: a blocked loop never ticks)."""
    ticks = 0
    ticked_while_waiting = threading.Event()

    def feeder(feed: ResponseFeed) -> None:
        if wait_for(lambda: ticks >= 5, timeout_s=10):
            ticked_while_waiting.set()
        feed.put(_response(0))
        feed.put(pb_utils.InferenceResponse([]), last=True)

    async def main() -> list[int | None]:
        nonlocal ticks
        feed = ResponseFeed()

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        threading.Thread(target=feeder, args=(feed,), daemon=True).start()
        responses = await ResponseIterator(feed).wait_first_async()
        ticker.cancel()
        return [_value(r) for r in responses]

    assert asyncio.run(main()) == [0, None]
    assert ticked_while_waiting.is_set()  # the loop ran while the first response was awaited


def test_a_cancelled_async_caller_leaves_the_feed_working() -> None:
    async def main() -> ResponseFeed:
        feed = ResponseFeed()
        waiter = asyncio.ensure_future(ResponseIterator(feed).wait_first_async())
        await asyncio.sleep(0.01)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        return feed

    feed = asyncio.run(main())
    gc.collect()
    feed.put(_response(0))  # no InvalidStateError
    feed.put(_response(1), last=True)


# ------------------------------------------------- the worker's BLS client


class _FakeLink:
    """SchedulerLink.schedule: the decoupled target's responses, GAP_S apart."""

    def __init__(
        self,
        values: list[int],
        raise_at_end: Exception | None = None,
        final: int | None = None,
        gate: threading.Event | None = None,
    ) -> None:
        self.values = values
        self.raise_at_end = raise_at_end
        self.final = final  # the last response's OUT; None: the final flag alone
        self.gate = gate  # set: the rest after the first response waits for it (10 s at most)
        self.sent = 0  # requests received
        self.streamed = 0  # responses handed to on_more

    async def schedule(self, request, on_more=None) -> pb.ScheduleResponse:
        self.sent += 1
        for i, v in enumerate(self.values):
            resp = pb.ScheduleResponse(more=True)
            _out(resp, v)
            # counted before it is handed over: the caller's thread may check
            # the count as soon as it has the response
            self.streamed += 1
            on_more(resp)
            if i == 0 and self.gate is not None:
                await asyncio.to_thread(self.gate.wait, 10)
            else:
                await asyncio.sleep(GAP_S)
        if self.raise_at_end is not None:
            raise self.raise_at_end
        if self.final is not None:
            return _out(pb.ScheduleResponse(), self.final)
        return pb.ScheduleResponse(no_response=True)  # the final flag alone


def _out(resp: pb.ScheduleResponse, value: int) -> pb.ScheduleResponse:
    resp.outputs.add(
        name="OUT", datatype="INT32", shape=[1], raw=numpy_to_raw(np.array([value], np.int32))
    )
    return resp


@pytest.fixture
def client() -> Iterator[BlsClient]:
    """A BlsClient on a loop of its own thread, its link and model lookups faked."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    c = BlsClient.__new__(BlsClient)
    c.loop = loop
    c._streams = set()
    c.link = _FakeLink([0, 1])  # type: ignore[assignment]  # fake

    async def model(name):
        return SimpleNamespace(spec=SimpleNamespace(decoupled=True), generation=1)

    # Faked methods: no model repository or recorder behind this client.
    c._model = model  # type: ignore[method-assign]
    c._schedule_request = (  # type: ignore[method-assign]
        lambda request, loaded: pb.ScheduleRequest(model="gen")
    )
    c._record = lambda *args: None  # type: ignore[method-assign]
    try:
        yield c
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def _request() -> pb_utils.InferenceRequest:
    return pb_utils.InferenceRequest(model_name="gen", requested_output_names=["OUT"], inputs=[])


@pytest.mark.parametrize("use_async", [False, True])
def test_client_streams_from_its_loop(client: BlsClient, use_async: bool) -> None:
    """Ordered by events, not timed: the link streams the second response only
    once the caller has the first (or after 10 s, if the call waited for more)."""
    gate = threading.Event()
    link = _FakeLink([0, 1], gate=gate)
    client.link = link  # type: ignore[assignment]  # fake
    if use_async:
        responses = asyncio.run(client.execute_async(_request(), True))
    else:
        responses = client.execute(_request(), True)
    assert _value(next(responses)) == 0
    assert link.streamed == 1  # returned with the first response, not at the end
    gate.set()
    assert [_value(r) for r in responses] == [1, None]
    assert wait_for(lambda: not client._streams)  # the call is gone once ended


def test_client_call_raising_midstream_raises_in_the_caller(client: BlsClient) -> None:
    link = _FakeLink([0], raise_at_end=RuntimeError("link broke"))
    client.link = link  # type: ignore[assignment]  # fake
    responses = client.execute(_request(), True)
    assert _value(next(responses)) == 0
    with pytest.raises(RuntimeError, match="link broke"):
        next(responses)


def test_client_stream_dropped_early_runs_to_its_end(client: BlsClient) -> None:
    client.link = _FakeLink(list(range(5)))  # type: ignore[assignment]  # fake
    responses = client.execute(_request(), True)
    assert _value(next(responses)) == 0
    feed = responses._feed
    del responses
    gc.collect()
    assert feed.abandoned
    assert wait_for(lambda: not client._streams, timeout_s=10)
    assert feed._queue.empty()


def test_client_not_decoupled_answers_the_one_response(client: BlsClient) -> None:
    client.link = _FakeLink([])  # type: ignore[assignment]  # fake
    response = client.execute(_request(), False)
    assert response.error() is not None  # the target is decoupled: INVALID_ARG
    assert response.error().code() == pb_utils.TritonError.INVALID_ARG


@pytest.mark.parametrize("decoupled", [False, True], ids=["one_response", "decoupled"])
def test_async_exec_is_a_future_already_sent(client: BlsClient, decoupled: bool) -> None:
    """pb_utils' async_exec() through the worker's BLS client, as Triton 2.51's:
    an asyncio Future whose request is sent before the caller awaits (two sent
    at once run together), that asyncio.wait takes, and that answers what
    exec() answers."""
    link = _FakeLink([0, 1] if decoupled else [], final=None if decoupled else 7)
    client.link = link  # type: ignore[assignment]  # fake

    async def model(name):
        return SimpleNamespace(spec=SimpleNamespace(decoupled=decoupled), generation=1)

    client._model = model  # type: ignore[method-assign]  # a faked model lookup

    async def caller() -> list:
        calls = [_request().async_exec(decoupled=decoupled) for _ in range(2)]
        assert all(isinstance(c, asyncio.Future) for c in calls)
        # Blocks this loop: only requests already sent can reach the link,
        # and both are in flight together.
        assert wait_for(lambda: link.sent == 2), link.sent
        done, pending = await asyncio.wait(calls, timeout=5)
        assert not pending
        return [c.result() for c in calls]

    saved, pb_utils.InferenceRequest._bls = pb_utils.InferenceRequest._bls, client
    try:
        answers = asyncio.run(caller())
    finally:
        pb_utils.InferenceRequest._bls = saved
    expected = client.execute(_request(), decoupled)  # what exec() answers
    for answer in answers:
        assert type(answer) is type(expected)
        if decoupled:
            assert not hasattr(answer, "__aiter__")  # a plain iterator, as Triton's
            assert [_value(r) for r in answer] == [_value(r) for r in expected] == [0, 1, None]
        else:
            assert _value(answer) == _value(expected) == 7


def test_async_exec_that_cannot_be_sent_fails_when_awaited() -> None:
    """A stub whose worker is gone: the call's error comes from the future."""
    ours, theirs = socket.socketpair()
    theirs.close()
    proxy = _BlsProxy(StubSocket(ours))  # the stub's real one
    saved, pb_utils.InferenceRequest._bls = pb_utils.InferenceRequest._bls, proxy

    async def caller() -> None:
        call = _request().async_exec()
        assert isinstance(call, asyncio.Future)
        with pytest.raises(OSError):
            await call

    try:
        asyncio.run(caller())
    finally:
        pb_utils.InferenceRequest._bls = saved
        ours.close()


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# ------------------------------------------------------ a model.py in a stub

# Calls "gen" with exec(decoupled=True) (IN[0] = 1: async_exec; 2: reads one
# response, drops the iterator, then calls again and reads all). T: seconds
# from the call when each response came, R: when exec returned, V: values.
# A file in RETURNED each time exec returns: the fake worker client streams
# a call's second response only after it (_FakeWorkerClient.returned).
STUB_CALLER = """\
import pathlib
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        mode = int(pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()[0])
        bls = pb_utils.InferenceRequest(model_name="gen", requested_output_names=["OUT"],
                                        inputs=[])
        if mode == 2:
            first = bls.exec(decoupled=True)
            pathlib.Path(RETURNED, uuid.uuid4().hex).touch()
            next(first)
            del first
        start = time.monotonic()
        responses = await bls.async_exec(decoupled=True) if mode == 1 else bls.exec(
            decoupled=True)
        returned = time.monotonic() - start
        pathlib.Path(RETURNED, uuid.uuid4().hex).touch()
        arrived, values = [], []
        for r in responses:
            arrived.append(time.monotonic() - start)
            o = pb_utils.get_output_tensor_by_name(r, "OUT")
            values.append(-1 if o is None else int(o.as_numpy()[0]))
        return [pb_utils.InferenceResponse([
            pb_utils.Tensor("T", np.array(arrived, np.float64)),
            pb_utils.Tensor("R", np.array([returned], np.float64)),
            pb_utils.Tensor("V", np.array(values, np.int64))])]
"""


# How long PAIR_CALLER blocks its loop waiting for both calls to reach the
# worker: only reached when async_exec does not send before it is awaited.
ARRIVAL_WAIT_S = 10.0

# Calls "gen" twice with async_exec (IN[0] = 1: decoupled=True), blocks its
# loop until the worker has both calls (a file each in ARRIVED, written by
# the fake worker client; at most ARRIVAL_WAIT_S), then awaits both with
# asyncio.wait. A: when it began to await (time.monotonic(), one clock for
# every process), V: the values. Waiting on the arrivals, not for a fixed
# time, keeps the test independent of how fast a loaded machine delivers them.
PAIR_CALLER = f"""\
import asyncio
import pathlib
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        decoupled = bool(pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()[0])
        calls = [pb_utils.InferenceRequest(model_name="gen", requested_output_names=["OUT"],
                                           inputs=[]).async_exec(decoupled=decoupled)
                 for _ in range(2)]
        assert all(isinstance(c, asyncio.Future) for c in calls), calls
        arrived = pathlib.Path(ARRIVED)
        deadline = time.monotonic() + {ARRIVAL_WAIT_S}
        while len(list(arrived.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # no await: only calls already sent reach the worker
        awaiting = time.monotonic()
        done, pending = await asyncio.wait(calls)
        values = []
        for call in calls:
            answer = call.result()
            if decoupled:
                assert type(answer).__name__ == "ResponseIterator", type(answer)
                responses = list(answer)
            else:
                assert isinstance(answer, pb_utils.InferenceResponse), type(answer)
                responses = [answer]
            for r in responses:
                o = pb_utils.get_output_tensor_by_name(r, "OUT")
                values.append(-1 if o is None else int(o.as_numpy()[0]))
        return [pb_utils.InferenceResponse([
            pb_utils.Tensor("A", np.array([awaiting], np.float64)),
            pb_utils.Tensor("V", np.array(values, np.int64))])]
"""


class _FakeWorkerClient:
    """pb_utils.InferenceRequest._bls in the worker: "gen" streams 0, 1, final
    (or, not decoupled, answers 7)."""

    def __init__(self, arrived: Path | None = None, returned: Path | None = None) -> None:
        self.calls = 0
        self.sent_at: list[float] = []  # time.monotonic() of each call's arrival
        self.arrived = arrived  # a file per call is written here, after sent_at
        # Set: a call's second response is streamed only once the caller's
        # exec has returned that call (its n-th file here; 10 s at most), and
        # `in_order` records, per call, whether it had.
        self.returned = returned
        self.in_order: dict[int, bool] = {}  # call number: in time
        self.feeders: list[threading.Thread] = []

    def _arrival(self) -> None:
        self.calls += 1
        self.sent_at.append(time.monotonic())
        if self.arrived is not None:
            (self.arrived / str(self.calls)).touch()

    def stream(self, request: pb_utils.InferenceRequest) -> ResponseIterator:
        assert request.model_name() == "gen"
        self._arrival()
        feed = ResponseFeed()
        if self.returned is None:
            _later(feed, (0, 0), (GAP_S, 1), (0, None))
        else:
            feeder = threading.Thread(target=self._gated, args=(feed, self.calls), daemon=True)
            self.feeders.append(feeder)
            feeder.start()
        return ResponseIterator(feed)

    def _gated(self, feed: ResponseFeed, call: int) -> None:
        assert self.returned is not None
        returned = self.returned
        feed.put(_response(0), False)
        self.in_order[call] = wait_for(lambda: len(list(returned.iterdir())) >= call, 10.0)
        feed.put(_response(1), False)
        feed.put(pb_utils.InferenceResponse([]), True)

    def response(self, request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponse:
        assert request.model_name() == "gen"
        self._arrival()
        return _response(7)


@pytest.fixture
def stub_instance(tmp_path: Path) -> Iterator[tuple[ProcessInstance, _FakeWorkerClient]]:
    returned = tmp_path / "returned"
    returned.mkdir()
    yield from _stub_instance(
        tmp_path,
        f"RETURNED = {str(returned)!r}\n{STUB_CALLER}",
        [("T", "FP64", (-1,)), ("R", "FP64", (1,)), ("V", "INT64", (-1,))],
        returned=returned,
    )


@pytest.fixture
def stub_pair(tmp_path: Path) -> Iterator[tuple[ProcessInstance, _FakeWorkerClient]]:
    arrived = tmp_path / "arrived"
    arrived.mkdir()
    yield from _stub_instance(
        tmp_path,
        f"ARRIVED = {str(arrived)!r}\n{PAIR_CALLER}",
        [("A", "FP64", (1,)), ("V", "INT64", (-1,))],
        arrived,
    )


def _stub_instance(
    tmp_path: Path,
    source: str,
    outputs: list,
    arrived: Path | None = None,
    returned: Path | None = None,
) -> Iterator[tuple[ProcessInstance, _FakeWorkerClient]]:
    text = python_config_text("caller", [("IN", "INT32", (1,))], outputs, max_batch_size=0)
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.py").write_text(source)
    fake = _FakeWorkerClient(arrived, returned)
    saved, pb_utils.InferenceRequest._bls = pb_utils.InferenceRequest._bls, fake
    inst = ProcessInstance(
        tmp_path / "1" / "model.py",
        to_spec(parse_config_text(text)),
        "{}",
        instance_name="caller_0_0",
        kind="KIND_CPU",
        device_id=-1,
        version=1,
    )
    try:
        yield inst, fake
    finally:
        inst.close()
        pb_utils.InferenceRequest._bls = saved


def _run(inst: ProcessInstance, mode: int) -> dict[str, list]:
    req = pb.ExecuteRequest(request_batch_sizes=[1])
    req.inputs.add(
        name="IN", datatype="INT32", shape=[1], raw=numpy_to_raw(np.array([mode], np.int32))
    )
    req.requested.add()
    resp = inst.execute_batch(req, None)
    assert isinstance(resp, pb.ExecuteResponse)  # not decoupled: answered on return
    assert resp.failure == pb.FAILURE_NONE, resp.message
    return {
        t.name: raw_to_numpy(t.raw, t.datatype, t.shape).tolist() for t in resp.results[0].outputs
    }


@pytest.mark.parametrize("mode", [0, 1, 2], ids=["exec", "async_exec", "after_early_stop"])
def test_stub_gets_each_response_as_it_comes(stub_instance, mode: int) -> None:
    inst, fake = stub_instance
    out = _run(inst, mode)
    assert out["V"] == [0, 1, -1]
    # each exec returned with its first response, before the second was sent
    for feeder in fake.feeders:  # a dropped call's feeder may still be finishing
        feeder.join(15)
    assert fake.in_order == {call: True for call in range(1, fake.calls + 1)}
    assert out["R"][0] < out["T"][1]
    assert fake.calls == (2 if mode == 2 else 1)


@pytest.mark.parametrize("decoupled", [False, True], ids=["one_response", "decoupled"])
def test_stub_async_exec_sends_before_the_caller_awaits(stub_pair, decoupled: bool) -> None:
    """In a stub process too: both calls reach the worker while the caller's
    loop is still blocked, asyncio.wait takes them, the answers are exec()'s."""
    inst, fake = stub_pair
    out = _run(inst, int(decoupled))
    assert out["V"] == ([0, 1, -1, 0, 1, -1] if decoupled else [7, 7])
    assert fake.calls == 2
    awaiting = out["A"][0]
    assert all(t < awaiting for t in fake.sent_at), (fake.sent_at, awaiting)
