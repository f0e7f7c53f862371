"""BLS to a decoupled model streams into the caller, as in Triton 2.51.

`exec(decoupled=True)` and `await async_exec(decoupled=True)` return once
the target's first response is in, and the iterator they return yields each
response as the target sends it (a plain iterator in both cases: `async for`
fails, in Triton too), the final flag alone as an empty last response. So a
decoupled BLS model forwarding a decoupled model's tokens (the common LLM
pattern) sends each on at once. The same model.py files run against
StageServe, in-process and in a stub process per instance
(STAGESERVE_INSTANCE_PROCESS), and against real Triton 2.51 (`triton`
fixture; skipped without .venv-triton).
"""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from bench.references import wait_ready
from stageserve_tools.examples import python_config_text, write_python_model
from tests.integration.helpers import triton_grpc
from tests.stack import running_stack

GAP_S = 0.5  # the target's pause between its responses

# The decoupled target: OUT = 0 at once, then 1 and 2 GAP_S apart, then the
# final flag alone.
TOKENS = f"""\
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            for i in range(3):
                if i:
                    time.sleep({GAP_S})
                out = pb_utils.Tensor("OUT", np.array([i], np.int32))
                sender.send(pb_utils.InferenceResponse([out]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

# Calls the target with exec(decoupled=True), or async_exec(decoupled=True)
# when the request parameter "async" is set. T: when each response came, V:
# its OUT (-1: an empty response), R: when exec / the await returned (seconds
# from the call). The TypeError of `async for` on the iterator is the error.
CALLER = """\
import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        out = []
        for r in requests:
            bls = pb_utils.InferenceRequest(
                model_name="py_tokens", requested_output_names=["OUT"],
                inputs=[pb_utils.get_input_tensor_by_name(r, "IN")])
            use_async = json.loads(r.parameters()).get("async")
            start = time.monotonic()
            responses = await bls.async_exec(decoupled=True) if use_async else bls.exec(
                decoupled=True)
            returned = time.monotonic() - start
            if use_async:
                try:
                    async for _ in responses:
                        pass
                except TypeError as exc:
                    assert "__aiter__" in str(exc), exc
                else:
                    raise AssertionError("async for worked")
            arrived, values = [], []
            for response in responses:
                arrived.append(time.monotonic() - start)
                o = pb_utils.get_output_tensor_by_name(response, "OUT")
                values.append(-1 if o is None else int(o.as_numpy()[0]))
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("T", np.array(arrived, np.float64)),
                pb_utils.Tensor("V", np.array(values, np.int32)),
                pb_utils.Tensor("R", np.array([returned], np.float64))]))
        return out
"""

# Decoupled: forwards each of the target's responses to its own stream as it
# comes (the common LLM pattern), then its final flag.
FORWARD = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            bls = pb_utils.InferenceRequest(
                model_name="py_tokens", requested_output_names=["OUT"],
                inputs=[pb_utils.get_input_tensor_by_name(r, "IN")])
            for response in bls.exec(decoupled=True):
                if response.output_tensors():
                    sender.send(pb_utils.InferenceResponse(response.output_tensors()))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

STUB = '\nparameters { key: "STAGESERVE_INSTANCE_PROCESS" value { string_value: "true" } }\n'
CALLERS = ["py_stream_caller", "py_stream_caller_stub"]
FORWARDERS = ["py_forward", "py_forward_stub"]
IN = [("IN", "INT32", (1,))]
OUT = [("OUT", "INT32", (1,))]


def write_repository(root):
    write_python_model(
        root,
        "py_tokens",
        TOKENS,
        python_config_text("py_tokens", IN, OUT, max_batch_size=0, decoupled=True),
    )
    for name in CALLERS:
        config = python_config_text(
            name,
            IN,
            [("T", "FP64", (-1,)), ("V", "INT32", (-1,)), ("R", "FP64", (1,))],
            max_batch_size=0,
        )
        write_python_model(root, name, CALLER, config + (STUB if "stub" in name else ""))
    for name in FORWARDERS:
        config = python_config_text(name, IN, OUT, max_batch_size=0, decoupled=True)
        write_python_model(root, name, FORWARD, config + (STUB if "stub" in name else ""))
    return root


@pytest.fixture(scope="module", params=["stageserve", "triton"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """The gRPC address of StageServe, then of real Triton, on the same models
    (Triton runs every instance in a stub process and ignores the parameter)."""
    root = write_repository(tmp_path_factory.mktemp("repo"))
    models = ["py_tokens", *CALLERS, *FORWARDERS]
    if request.param == "triton":
        with triton_grpc(root, tmp_path_factory.mktemp("triton"), models) as url:
            yield url
        return
    with running_stack(root) as stack:
        wait_ready(stack.url, models, 120)
        yield stack.url


def _in() -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("IN", [1], "INT32")
    inp.set_data_from_numpy(np.zeros(1, np.int32))
    return [inp]


@pytest.mark.parametrize("use_async", [False, True], ids=["exec", "async_exec"])
@pytest.mark.parametrize("caller", CALLERS)
def test_bls_iterator_yields_each_response_as_it_comes(
    server: str, caller: str, use_async: bool
) -> None:
    with grpcclient.InferenceServerClient(server) as c:
        r = c.infer(caller, _in(), parameters={"async": use_async}, client_timeout=30)
    arrived, values = r.as_numpy("T").tolist(), r.as_numpy("V").tolist()
    returned = float(r.as_numpy("R")[0])
    assert values == [0, 1, 2, -1]  # the final flag alone: an empty last response
    # Each response reached the caller as the target sent it (2 * GAP_S from
    # the first to the last; all at the end before), and exec / the await
    # returned with the first one, not once the target finished.
    assert arrived[2] - arrived[0] > 0.4, arrived
    assert returned < arrived[2] - 0.4, (returned, arrived)


@pytest.mark.parametrize("forwarder", FORWARDERS)
def test_forwarding_model_streams_tokens_to_its_client(server: str, forwarder: str) -> None:
    answers: queue.Queue = queue.Queue()

    def got(result, error) -> None:
        answers.put((time.monotonic(), error or int(result.as_numpy("OUT")[0])))

    c = grpcclient.InferenceServerClient(server)
    try:
        c.start_stream(callback=got)
        c.async_stream_infer(forwarder, _in())
        received = [answers.get(timeout=30) for _ in range(3)]
    finally:
        c.stop_stream()
        c.close()
    assert [v for _, v in received] == [0, 1, 2]
    # The first reached the client long before the last.
    assert received[2][0] - received[0][0] > 0.4
