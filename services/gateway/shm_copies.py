"""Which of a request's shared-memory copies leave the event loop, and what
lets them leave without changing any answer (pure: dataplane.py runs them).

A request's input reads, and apart from them its output writes, that total
more than GatewaySettings.shm_copy_thread_bytes run in a worker thread
through Region.read_in_thread / write_in_thread (copies that release the GIL:
shared_memory.py); smaller ones stay on the loop, where they cost less than
the hop to a thread.

Inputs are read before validation: `input_refs` picks, out of the
references validation.shared_inputs parsed (validation reuses them), those
whose bytes the gateway copies (the in-place path's CUDA inputs are the
worker's to read); `read_ahead` reads them in the request's order, keeping
each one's bytes or the error its read raised; `served` is the reader
validate_infer then gets. Validation asks for each input where it would read
it and meets the same error there, so a request's answer (its status, its
message, which check comes first) is the one reading inline gives.

An output's bytes are taken out of the response message once, with the GIL
held (protobuf copies a bytes field on every read: 44 ms per 64 MB on the
development VM); only the copy into the region leaves it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from services.gateway.shared_memory import Region
from stageserve.datatypes import BY_TRITON
from stageserve.errors import internal
from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import stageserve_pb2 as pb
from stageserve.tensors import element_count
from stageserve.validation import ReadShared, SharedRef

#: (an input's reference, its datatype) -> whether the in-place path takes it
TakenInPlace = Callable[[SharedRef, str], bool]
#: a reference's bytes, or the error its read raised
ReadResult = bytes | Exception


def in_thread(byte_sizes: Iterable[int], threshold: int) -> bool:
    """Whether copies of these sizes, one request's, run in a worker thread."""
    return sum(byte_sizes) > threshold


def input_refs(
    request: gs.ModelInferRequest,
    shared: Mapping[str, SharedRef],
    taken: TakenInPlace | None = None,
) -> list[SharedRef]:
    """The shared-memory inputs (`shared`: validation.shared_inputs of the
    request) whose bytes the gateway copies, in the request's order: all of
    them but those `taken` in place."""
    refs = []
    for tensor in request.inputs:
        ref = shared.get(tensor.name)
        if ref is not None and not (taken is not None and taken(ref, tensor.datatype)):
            refs.append(ref)
    return refs


def read_ahead(refs: Iterable[SharedRef], read: ReadShared) -> dict[SharedRef, ReadResult]:
    """Each reference's bytes or its read's error, read once each. None is read
    after a failed one: validation, which asks in the same order, ends there."""
    done: dict[SharedRef, ReadResult] = {}
    for ref in refs:
        if ref in done:
            continue
        try:
            done[ref] = read(ref)
        except Exception as exc:  # raised again where validation asks for it
            done[ref] = exc
            break
    return done


def served(done: Mapping[SharedRef, ReadResult], fallback: ReadShared) -> ReadShared:
    """validate_infer's reader over `done`: its bytes, its error raised again;
    a reference not read ahead is read by `fallback` then."""

    def read(ref: SharedRef) -> bytes:
        found = done.get(ref)
        if found is None:
            return fallback(ref)
        if isinstance(found, Exception):
            raise found
        return found

    return read


@dataclass(frozen=True)
class OutputWrite:
    """An output bound for its client's region (the response's entry stays
    empty, as Triton's)."""

    region: Region
    ref: SharedRef
    tensor: pb.Tensor

    def byte_size(self) -> int:
        """The bytes it writes, without reading them (protobuf copies a bytes
        field on every read): a fixed-size datatype's from the shape, a BYTES
        output's bounded by its window. Only where the copy runs depends on it."""
        datatype = BY_TRITON.get(self.tensor.datatype)
        if datatype is None or not datatype.item_size:
            return self.ref.byte_size
        return element_count(self.tensor.shape) * datatype.item_size


def write_outputs(writes: Iterable[OutputWrite], in_thread: bool = False) -> None:
    """Each output into its region, in order; an output larger than its
    window is Triton's INTERNAL (the outputs before it are written)."""
    for w in writes:
        raw = w.tensor.raw  # read once: 44 ms per 64 MB copied out of the message
        if len(raw) > w.ref.byte_size:
            raise internal(
                f"shared memory size specified with the request for output '{w.tensor.name}' "
                f"({w.ref.byte_size} bytes) should be at least {len(raw)} bytes to hold the "
                f"results",
            )
        if in_thread:
            w.region.write_in_thread(w.ref.offset, raw)
        else:
            w.region.write(w.ref.offset, raw)
