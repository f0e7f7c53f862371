"""Shared-memory tensors made safe to run by default (issue 26 item 3):
a request whose input slots the gateway freed and handed out again fails
CANCELLED instead of answering from another request's bytes; a reference to
a region the worker cannot map is refused with its own reason; the host id
tells apart processes that do not share /dev/shm; a region that /dev/shm
cannot hold is refused at creation, not by a SIGBUS at the first write."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from services.worker.service import _failed
from stageserve import tensor_shm
from stageserve.errors import StageError
from stageserve.generated import stageserve_pb2 as pb
from stageserve.settings import StackSettings
from stageserve.tensor_region import SHM_DIR, TensorRegion, pid_namespace, region_name
from stageserve.tensor_shm import (
    RegionNotLocal,
    TensorShm,
    host_id,
    materialize_batch,
    retaken_rows,
    take_outputs,
    tensor_bytes,
)
from tests.hosted import hosted_simple

ROW = 16 * 4  # one INT32[16] row of the simple model: one slot of 64 bytes


def _row(value: int) -> pb.Tensor:
    raw = np.full(16, value, np.int32).tobytes()
    return pb.Tensor(name="INPUT0", datatype="INT32", shape=[1, 16], raw=raw)


def _batch(first: pb.Tensor, second: pb.Tensor) -> pb.ExecuteRequest:
    """A batch of two requests, as the scheduler forms it: the first's INPUT0
    a reference into the gateway's region, the second's inline bytes; INPUT1
    inline zeros (OUTPUT0 = INPUT0 + INPUT1)."""
    request = pb.ExecuteRequest(id=1, instance_id="w/simple/1/g1/0")
    x0 = request.inputs.add(name="INPUT0", datatype="INT32", shape=[2, 16])
    x0.parts.extend(first.parts)
    x0.parts.add(raw=second.raw)
    request.inputs.add(name="INPUT1", datatype="INT32", shape=[2, 16], raw=bytes(2 * ROW))
    for _ in range(2):
        request.request_batch_sizes.append(1)
        request.requested.add(names=["OUTPUT0"])
    return request


def _output0(result: pb.RequestOutputs) -> list[int]:
    return np.frombuffer(result.outputs[0].raw, np.int32).tolist()


@pytest.fixture
def gateway() -> Iterator[TensorShm]:
    # two slots: a freed extent is the next one handed out (next-fit wraps);
    # a stack name per test: readers keep peers' regions mapped by name
    gw = TensorShm(f"unitretake{uuid.uuid4().hex[:8]}", "gateway", 2, ROW, ROW)
    yield gw
    gw.close()


def test_a_request_whose_slots_were_retaken_fails_cancelled(
    tmp_path: Path, gateway: TensorShm
) -> None:
    inst = hosted_simple(tmp_path)
    cancelled = _row(7)
    held = gateway.stage_inputs([cancelled])
    assert held and held[0].generation
    request = _batch(cancelled, _row(5))
    # the client gives up while the batch is queued: the gateway frees the
    # slot, and the next request's bytes take it
    gateway.release(held)
    gateway.stage_inputs([pb.Tensor(datatype="INT32", raw=np.full(16, 99, np.int32).tobytes())])
    gateway.stage_inputs([pb.Tensor(datatype="INT32", raw=np.full(16, 99, np.int32).tobytes())])
    assert bytes(tensor_bytes(cancelled)) == np.full(16, 99, np.int32).tobytes()
    resp = inst.execute(request)
    assert isinstance(resp, pb.ExecuteResponse)
    first, second = resp.results
    assert first.failure == pb.CANCELLED and not first.outputs  # never 99s as its answer
    assert not second.failure and _output0(second) == [5] * 16  # the rest of the batch ran


def test_a_request_whose_slots_were_not_retaken_answers(tmp_path: Path, gateway: TensorShm) -> None:
    inst = hosted_simple(tmp_path)
    mine = _row(7)
    held = gateway.stage_inputs([mine])
    resp = inst.execute(_batch(mine, _row(5)))
    assert isinstance(resp, pb.ExecuteResponse)
    assert [_output0(r) for r in resp.results] == [[7] * 16, [5] * 16]
    assert retaken_rows(_batch(mine, _row(5))) == set()
    gateway.release(held)


def test_freed_but_not_retaken_slots_still_answer(tmp_path: Path, gateway: TensorShm) -> None:
    """Freed, not yet handed out: the bytes are still the request's own."""
    inst = hosted_simple(tmp_path)
    mine = _row(3)
    gateway.release(gateway.stage_inputs([mine]))
    resp = inst.execute(_batch(mine, _row(4)))
    assert isinstance(resp, pb.ExecuteResponse)
    assert [_output0(r) for r in resp.results] == [[3] * 16, [4] * 16]


def test_a_copied_batch_reports_the_requests_whose_slots_were_retaken(
    gateway: TensorShm,
) -> None:
    """The path of the backends that read raw bytes (Python models): the
    check follows the copy."""
    mine = _row(1)
    held = gateway.stage_inputs([mine])
    request = _batch(mine, _row(2))
    gateway.release(held)
    gateway.stage_inputs([_row(9)])
    gateway.stage_inputs([_row(9)])
    assert materialize_batch(request) == {0}
    assert not request.inputs[0].parts and len(request.inputs[0].raw) == 2 * ROW


def test_a_region_the_worker_cannot_map_is_refused_with_its_own_reason() -> None:
    t = pb.Tensor(
        name="x", datatype="FP32", parts=[pb.TensorPart(region="stageserve-x-gw-1", length=4)]
    )
    with pytest.raises(RegionNotLocal, match="not on this host"):
        tensor_bytes(t)


def test_the_worker_answers_a_batch_it_cannot_map_region_not_local(tmp_path: Path) -> None:
    """Not a bad input: the gateway resends a TENSOR_REGION_NOT_LOCAL request inline."""
    inst = hosted_simple(tmp_path)
    request = _batch(
        pb.Tensor(parts=[pb.TensorPart(region="stageserve-gone-gateway-1", length=ROW)]),
        _row(5),
    )
    with pytest.raises(RegionNotLocal) as raised:
        inst.execute(request)
    resp = _failed(inst, request, raised.value)
    assert resp.failure == pb.TENSOR_REGION_NOT_LOCAL


def test_host_id_names_the_shm_device_and_the_pid_namespace() -> None:
    host = host_id()
    assert f"/{os.stat(SHM_DIR).st_dev}/" in host
    assert host.endswith(os.readlink("/proc/self/ns/pid"))


def test_a_process_with_its_own_dev_shm_has_another_host_id() -> None:
    """Same hostname, boot id and pid namespace, another tmpfs on /dev/shm
    (a container's): not the same host for shared memory."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        pytest.skip("needs unshare and root to mount a private /dev/shm")
    script = (
        "mount -t tmpfs -o size=1m tmpfs /dev/shm && "
        f"{sys.executable} -c 'from stageserve.tensor_shm import host_id; print(host_id())'"
    )
    child = subprocess.run(
        [unshare, "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    if child.returncode != 0 and "Operation not permitted" in child.stderr:
        pytest.skip(f"no mount namespace here: {child.stderr.strip()}")
    assert child.returncode == 0, child.stderr
    theirs = child.stdout.strip()
    assert theirs and theirs != host_id()
    assert theirs.split("/")[:2] == host_id().split("/")[:2]  # same name and boot id


def _too_big() -> tuple[int, int]:
    """(slots, slot size) of a region larger than the whole /dev/shm."""
    vfs = os.statvfs(SHM_DIR)
    slot = 1 << 20
    return 2 * vfs.f_blocks * vfs.f_frsize // slot + 1, slot


def test_a_region_dev_shm_cannot_hold_fails_at_creation() -> None:
    """tmpfs refuses an allocation larger than itself at once (nothing is
    reserved meanwhile); a sparse file would have mapped and crashed later."""
    name = region_name(f"unitbig{os.getpid()}", "gateway", os.getpid())
    slots, slot = _too_big()
    with pytest.raises(OSError):
        TensorRegion.create(name, slots, slot)
    assert not (SHM_DIR / name).exists()


def test_without_room_for_a_region_the_process_goes_inline() -> None:
    slots, slot = _too_big()
    settings = StackSettings(tensor_shm=1, tensor_shm_slots=slots, tensor_shm_slot_bytes=slot)
    assert tensor_shm.install(settings, f"redis://unitbig{os.getpid()}", "gateway") is None
    assert tensor_shm.OWNER is None


def test_an_output_the_worker_reclaimed_before_the_gateway_read_it_fails() -> None:
    wk = TensorShm(f"unitlost{uuid.uuid4().hex[:8]}", "worker", 1, ROW, ROW)
    try:
        out = pb.Tensor(name="OUTPUT0", datatype="INT32", shape=[16])
        assert wk.put_array(out, np.full(16, 1, np.int32), os.getpid())
        # the answer took past SHM_LOST_AFTER_S: the full region reclaims the slot
        assert wk.table.reclaim(lambda pid: False, older_than_ns=time.monotonic_ns() + 1)
        other = pb.Tensor(name="OUTPUT0", datatype="INT32", shape=[16])
        assert wk.put_array(other, np.full(16, 2, np.int32), os.getpid())
        with pytest.raises(StageError, match="reclaimed"):
            take_outputs([out])
        take_outputs([other])
        assert np.frombuffer(other.raw, np.int32).tolist() == [2] * 16
    finally:
        wk.close()


def test_reclaim_lost_frees_dead_and_lost_consumers_slots_only() -> None:
    """What a worker's periodic reclaim frees: slots of a dead gateway and
    slots tagged past SHM_LOST_AFTER_S (an answer lost with a killed
    scheduler); a live gateway's fresh output stays held."""
    wk = TensorShm(f"unitreclaim{uuid.uuid4().hex[:8]}", "worker", 4, ROW, ROW)
    try:
        live, dead = os.getpid(), _dead_pid()
        fresh = pb.Tensor(name="OUTPUT0", datatype="INT32", shape=[16])
        assert wk.put_array(fresh, np.full(16, 1, np.int32), live)
        orphan = pb.Tensor(name="OUTPUT0", datatype="INT32", shape=[16])
        assert wk.put_array(orphan, np.full(16, 2, np.int32), dead)
        lost = pb.Tensor(name="OUTPUT0", datatype="INT32", shape=[16])
        assert wk.put_array(lost, np.full(16, 3, np.int32), live)
        lost_slot = lost.parts[0].offset // wk.table.slot_size
        wk.table.stamps[lost_slot] -= int((tensor_shm.SHM_LOST_AFTER_S + 1) * 1e9)
        assert wk.in_use() == 3
        assert wk.reclaim_lost() == 2
        assert wk.in_use() == 1 and wk.reclaim_lost() == 0
        take_outputs([fresh])
        assert np.frombuffer(fresh.raw, np.int32).tolist() == [1] * 16
        assert wk.in_use() == 0
    finally:
        wk.close()


def _dead_pid() -> int:
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(child.stdout)


def test_a_starting_process_unlinks_dead_regions_of_any_stack_in_its_pid_namespace() -> None:
    """A stack killed whole (kill -9, never restarted) leaves its reserved
    regions; the next process on the host unlinks them, whatever its stack,
    but not one whose owner ran in another pid namespace (its pid means
    another process)."""
    dead = _dead_pid()
    gone = region_name(f"unitleft{uuid.uuid4().hex[:8]}", "worker", dead)
    foreign = region_name(f"unitleft{uuid.uuid4().hex[:8]}", "worker", dead)
    TensorRegion.create(gone, 1, 64)
    TensorRegion.create(foreign, 1, 64)
    with open(SHM_DIR / foreign, "r+b") as f:  # its header: another pid namespace
        f.seek(20)
        f.write((pid_namespace() + 1).to_bytes(8, "little"))
    starting = TensorShm(f"unitnew{uuid.uuid4().hex[:8]}", "gateway", 1, 64, 64)
    try:
        assert not (SHM_DIR / gone).exists()
        assert (SHM_DIR / foreign).exists()
    finally:
        starting.close()
        (SHM_DIR / foreign).unlink()
