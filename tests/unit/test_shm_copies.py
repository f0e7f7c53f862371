"""services/gateway/shm_copies.py, the pure part of moving large shared-memory
copies off the event loop: which copies are large, the read-ahead mapping,
and that reading ahead answers every request as the inline read does (over
real POSIX shm objects in /dev/shm)."""

from __future__ import annotations

import mmap
import uuid
from collections.abc import Iterator

import pytest

from services.gateway import shm_copies
from services.gateway.shared_memory import SHM_ROOT, SharedMemory
from services.gateway.shm_copies import OutputWrite
from stageserve.errors import StageError, invalid, not_found
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import stageserve_pb2 as pb
from stageserve.validation import (
    SharedRef,
    ValidatedRequest,
    shared_inputs,
    validate_infer,
)
from tests.unit.test_validation_shared_memory import SPEC, A, B  # the same model and rows


@pytest.fixture
def shm() -> Iterator[SharedMemory]:
    """Region 'in' holding A at 0 and B at 8, on a real shm object."""
    key = f"/stageserve-test-{uuid.uuid4().hex}"
    path = SHM_ROOT / key[1:]
    path.write_bytes((A + B).ljust(mmap.PAGESIZE, b"\0"))
    table = SharedMemory()
    table.register("in", key, 0, 16)
    yield table
    table.unregister()
    path.unlink(missing_ok=True)


def _ref(region: str = "in", offset: int = 0, size: int = 8) -> SharedRef:
    return SharedRef(region, offset, size)


# ------------------------------------------------------------ which are large


def test_copies_run_in_a_thread_only_past_the_threshold_in_total() -> None:
    assert not shm_copies.in_thread([], 0)
    assert not shm_copies.in_thread([512, 512], 1024)  # exactly the threshold: inline
    assert shm_copies.in_thread([512, 513], 1024)  # the request's total decides
    assert shm_copies.in_thread([2048], 1024)


def _request(a: dict | None = None, b: dict | None = None, **fields) -> gs.ModelInferRequest:
    r = gs.ModelInferRequest(model_name="m")
    for name, datatype, params in (("A", "FP32", a), ("B", "INT32", b)):
        t = r.inputs.add(name=name, datatype=fields.get(f"{name}_datatype", datatype))
        t.shape.extend(fields.get(f"{name}_shape", [1, 2]))
        for key, value in (params or {}).items():
            if isinstance(value, str):
                t.parameters[key].string_param = value
            else:
                t.parameters[key].int64_param = value
    return r


def _in(region: str = "in", offset: int = 0, size: int = 8) -> dict:
    return {
        "shared_memory_region": region,
        "shared_memory_offset": offset,
        "shared_memory_byte_size": size,
    }


def _refs(r: gs.ModelInferRequest, taken: shm_copies.TakenInPlace | None = None) -> list:
    return shm_copies.input_refs(r, shared_inputs(r.inputs, "m"), taken)


def test_input_refs_are_the_shared_memory_inputs_in_request_order() -> None:
    assert _refs(_request(_in(offset=8), _in(offset=0))) == [_ref(offset=8), _ref(offset=0)]
    assert _refs(_request(_in())) == [_ref()]  # B's bytes are raw
    assert _refs(_request()) == []


def test_inputs_the_in_place_path_takes_are_not_copied() -> None:
    r = _request(_in("gpu"), _in())
    seen: list[tuple[SharedRef, str]] = []

    def taken(ref: SharedRef, datatype: str) -> bool:
        seen.append((ref, datatype))
        return ref.region == "gpu"

    assert _refs(r, taken) == [_ref()]
    assert seen == [(_ref("gpu"), "FP32"), (_ref(), "INT32")]


def test_parsing_the_references_first_raises_validations_first_error() -> None:
    r = _request(_in(), {"shared_memory_region": "in", "shared_memory_byte_size": "8"})
    r.inputs[0].datatype = "INT32"  # a later check of validation's
    with pytest.raises(StageError) as gathered:
        shared_inputs(r.inputs, "m")
    with pytest.raises(StageError) as validated:
        validate_infer(r, SPEC, lambda ref: A)
    assert (gathered.value.code, gathered.value.message) == (
        validated.value.code,
        validated.value.message,
    )


# -------------------------------------------------------------- the read-ahead


def test_read_ahead_reads_each_reference_once_in_order() -> None:
    reads: list[SharedRef] = []

    def read(ref: SharedRef) -> bytes:
        reads.append(ref)
        return bytes([ref.offset])

    refs = [_ref(offset=2), _ref(offset=1), _ref(offset=2)]
    done = shm_copies.read_ahead(refs, read)
    assert reads == [_ref(offset=2), _ref(offset=1)]
    assert done == {_ref(offset=2): b"\x02", _ref(offset=1): b"\x01"}


def test_read_ahead_keeps_the_error_and_reads_nothing_after_it() -> None:
    error = not_found("Unable to find shared memory region: 'gone'")

    def read(ref: SharedRef) -> bytes:
        if ref.region == "gone":
            raise error
        return b"ok"

    done = shm_copies.read_ahead([_ref(), _ref("gone"), _ref(offset=8)], read)
    assert done == {_ref(): b"ok", _ref("gone"): error}


def test_served_answers_from_the_read_ahead_and_reads_the_rest_then() -> None:
    error = invalid("Invalid offset for shared memory region: 'in'")
    late: list[SharedRef] = []

    def fallback(ref: SharedRef) -> bytes:
        late.append(ref)
        return b"late"

    read = shm_copies.served({_ref(): b"ahead", _ref(offset=99): error}, fallback)
    assert read(_ref()) == b"ahead"
    with pytest.raises(StageError) as exc:
        read(_ref(offset=99))
    assert exc.value is error
    assert read(_ref(offset=8)) == b"late" and late == [_ref(offset=8)]


# ------------------------------------------------------------ same answers


def _answer(run) -> ValidatedRequest | tuple[str, str]:
    try:
        return run()
    except StageError as exc:
        return exc.code.name, exc.message


def _one_raw() -> gs.ModelInferRequest:
    r = _request(_in())
    r.raw_input_contents.append(B)
    return r


CASES = {
    "both in the region": lambda: _request(_in(), _in(offset=8)),
    "one raw": _one_raw,
    "unknown region": lambda: _request(_in("gone"), _in(offset=8)),
    "offset past the region": lambda: _request(_in(), _in(offset=16)),
    "window past the region": lambda: _request(_in(), _in(offset=8, size=16)),
    "window of the wrong size": lambda: _request(_in(size=4), _in(offset=8)),
    "a datatype error before an unknown region": lambda: _request(
        _in(), _in("gone"), A_datatype="INT32"
    ),
    "an unknown region before a shape error": lambda: _request(_in("gone"), _in(), B_shape=[1, 3]),
    "a shape error before an unknown region": lambda: _request(_in(), _in("gone"), A_shape=[1, 3]),
    "two unknown regions": lambda: _request(_in("gone"), _in("lost")),
    "an out-of-bounds window before an unknown region": lambda: _request(
        _in(offset=64), _in("gone")
    ),
    "a malformed reference": lambda: _request(_in(), {"shared_memory_region": "in"}),
}


@pytest.mark.parametrize("case", CASES)
def test_reading_ahead_answers_as_the_inline_read(shm: SharedMemory, case: str) -> None:
    request = CASES[case]()
    inline = _answer(lambda: validate_infer(request, SPEC, shm.read))

    def ahead() -> ValidatedRequest:
        shared = shared_inputs(request.inputs, "m")
        done = shm_copies.read_ahead(shm_copies.input_refs(request, shared), shm.read_in_thread)
        read = shm_copies.served(done, shm.read)
        return validate_infer(request, SPEC, read, shared=shared)

    assert _answer(ahead) == inline
    if case in ("both in the region", "one raw"):
        assert isinstance(inline, ValidatedRequest)
        assert [t.raw for t in inline.inputs] == [A, B]


# ---------------------------------------------------------------- the outputs


def _write(shm: SharedMemory, tensor: pb.Tensor, offset: int = 0, size: int = 8) -> OutputWrite:
    (region,) = shm.status("in")
    return OutputWrite(region, SharedRef("in", offset, size), tensor)


def test_an_outputs_size_comes_from_its_shape_or_for_bytes_its_window(shm: SharedMemory) -> None:
    fp32 = pb.Tensor(name="O", datatype="FP32", shape=[3, 2], raw=bytes(24))
    assert _write(shm, fp32, size=4096).byte_size() == 24
    strings = pb.Tensor(name="S", datatype="BYTES", shape=[1], raw=b"\x01\0\0\0x")
    assert _write(shm, strings, size=4096).byte_size() == 4096


@pytest.mark.parametrize("in_thread", [False, True])
def test_outputs_are_written_in_order_until_one_does_not_fit(
    shm: SharedMemory, in_thread: bool
) -> None:
    first = pb.Tensor(name="O", datatype="FP32", shape=[1, 2], raw=b"\xaa" * 8)
    too_big = pb.Tensor(name="P", datatype="FP32", shape=[1, 3], raw=b"\xbb" * 12)
    writes = [_write(shm, first), _write(shm, too_big, offset=8)]
    with pytest.raises(StageError) as exc:
        shm_copies.write_outputs(writes, in_thread)
    assert (exc.value.code.name, exc.value.message) == (
        "INTERNAL",
        "shared memory size specified with the request for output 'P' (8 bytes) should be "
        "at least 12 bytes to hold the results",
    )
    (region,) = shm.status("in")
    assert region.read(0, 16) == b"\xaa" * 8 + B  # the first written, the second not
