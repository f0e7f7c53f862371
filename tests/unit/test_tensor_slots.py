"""The shared-memory slot table (stageserve/tensor_slots.py) and its region file."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from services.gateway.tensor_transport import local_models
from stageserve.generated import stageserve_pb2 as pb
from stageserve.settings import StackSettings
from stageserve.tensor_region import TensorRegion, owner_pid, pid_alive, region_name, slots_in_use
from stageserve.tensor_shm import RegionNotLocal, TensorShm, take_outputs, tensor_bytes
from stageserve.tensor_slots import SlotTable


def table(slots: int = 8, slot_size: int = 100) -> SlotTable:
    return SlotTable(np.zeros(slots, np.uint32), np.zeros(slots, np.uint64), slot_size)


def test_alloc_takes_whole_slots_and_free_gives_them_back() -> None:
    t = table()
    a = t.alloc(100, 7, 1)
    b = t.alloc(101, 7, 1)  # two slots
    assert (a, b) == (0, 1)
    assert a is not None and b is not None
    assert t.in_use() == 3
    assert list(t.tags[:4]) == [7, 7, 7, 0]
    t.free(b, 101)
    assert t.in_use() == 1
    t.free(a, 100)
    assert t.in_use() == 0


def test_full_table_answers_none_never_raises() -> None:
    t = table(slots=4)
    assert t.alloc(400, 1, 0) == 0
    assert t.alloc(1, 1, 0) is None
    assert t.alloc(401, 1, 0) is None  # larger than the whole region


def test_extent_needs_consecutive_free_slots() -> None:
    t = table(slots=6)
    assert [t.alloc(100, 1, 0) for _ in range(6)] == list(range(6))
    for s in (0, 2, 3, 5):
        t.free(s, 100)
    assert t.alloc(200, 2, 0) == 2  # slots 2-3, the only free pair
    assert t.alloc(200, 2, 0) is None


def test_next_fit_wraps_around() -> None:
    t = table(slots=3)
    assert [t.alloc(1, 1, 0) for _ in range(3)] == [0, 1, 2]
    t.free(0, 1)
    assert t.alloc(1, 1, 0) == 0


def test_reclaim_frees_dead_owners_and_old_slots() -> None:
    t = table(slots=6)
    t.alloc(1, 10, 100)
    t.alloc(1, 11, 100)
    t.alloc(1, 12, 5)  # old
    assert t.reclaim(lambda pid: pid == 10) == 1
    assert t.reclaim(lambda pid: False, older_than_ns=50) == 1
    assert list(t.tags[:3]) == [0, 11, 0]


def test_bad_arguments_are_refused() -> None:
    t = table()
    with pytest.raises(ValueError):
        t.alloc(1, 0, 0)
    with pytest.raises(ValueError):
        t.free(99, 1)


def test_region_is_shared_between_mappings(tmp_path) -> None:
    name = region_name("unit", "test", os.getpid())
    region = TensorRegion.create(name, 4, 64)
    try:
        peer = TensorRegion.open(name, writable=True)
        reader = TensorRegion.open(name, writable=False)
        assert region.table is not None and peer.table is not None
        start = region.table.alloc(70, 42, 1)
        assert start == 0
        region.data[0:70] = b"x" * 70
        assert bytes(reader.extent(0, 70)) == b"x" * 70
        assert peer.table.in_use() == 2  # the peer sees the owner's table
        peer.table.free(0, 70)  # a consumer frees by zeroing the tags
        assert region.table.in_use() == 0
        assert reader.table is None
        assert owner_pid(name) == os.getpid()
    finally:
        region.unlink()


def test_audit_reclaims_slots_a_dead_process_was_to_free() -> None:
    dead = _dead_pid()
    region = TensorRegion.create(region_name("unitaudit", "worker", os.getpid()), 4, 64)
    try:
        assert region.table is not None
        region.table.alloc(64, dead, 1)  # an output for a gateway that was killed
        region.table.alloc(64, os.getpid(), 1)  # one a live process still holds
        assert slots_in_use("unitaudit") == {region.name: 1}
    finally:
        region.unlink()


def _dead_pid() -> int:
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(child.stdout)


def test_dead_owner_region_is_swept() -> None:
    dead = _dead_pid()
    assert not pid_alive(dead)
    name = region_name("unitsweep", "worker", dead)
    TensorRegion.create(name, 2, 64)
    live = TensorRegion.create(region_name("unitsweep", "gateway", os.getpid()), 2, 64)
    try:
        assert slots_in_use("unitsweep") == {live.name: 0}
        assert not os.path.exists(f"/dev/shm/{name}")
    finally:
        live.unlink()


def test_inputs_and_outputs_round_trip_through_regions() -> None:
    settings = StackSettings(tensor_shm=1, tensor_shm_min_bytes=64, tensor_shm_slots=8)
    gw = TensorShm("unitrt", "gateway", settings.tensor_shm_slots, 128, 64)
    wk = TensorShm("unitrt", "worker", 8, 128, 64)
    try:
        small = pb.Tensor(name="s", datatype="FP32", shape=[1], raw=b"abcd")
        big = pb.Tensor(name="b", datatype="FP32", shape=[50], raw=bytes(range(200)))
        text = pb.Tensor(name="t", datatype="BYTES", shape=[1], raw=b"\x00" * 100)
        held = gw.stage_inputs([small, big, text])
        assert len(held) == 1 and big.raw == b"" and big.parts[0].region == gw.region.name
        assert small.raw == b"abcd" and not text.parts  # small and BYTES stay inline
        assert bytes(tensor_bytes(big)) == bytes(range(200))
        assert gw.in_use() == 2
        gw.release(held)
        assert gw.in_use() == 0

        request = pb.ExecuteRequest(shm_hosts=[gw.host, "elsewhere/1"], shm_pids=[gw.pid, 9])
        resp = pb.ExecuteResponse()
        for _ in range(2):
            resp.results.add().outputs.add(name="o", datatype="FP32", raw=b"\x01" * 300)
        wk.stage_outputs(request, resp)
        near, far = resp.results
        assert near.outputs[0].parts and not far.outputs[0].parts  # another host: inline
        assert wk.in_use() == 3
        take_outputs(near.outputs)
        assert near.outputs[0].raw == b"\x01" * 300 and not near.outputs[0].parts
        assert wk.in_use() == 0
        # keep_raw=False: the bytes come back, the tensor keeps none; slots freed
        again = pb.ExecuteResponse()
        again.results.add().outputs.add(name="o", datatype="FP32", raw=b"\x02" * 300)
        wk.stage_outputs(request, again)
        assert again.results[0].outputs[0].parts and wk.in_use() == 3
        assert take_outputs(again.results[0].outputs, keep_raw=False) == [b"\x02" * 300]
        assert again.results[0].outputs[0].raw == b"" and not again.results[0].outputs[0].parts
        assert wk.in_use() == 0
    finally:
        gw.close()
        wk.close()


def test_full_region_falls_back_to_inline() -> None:
    gw = TensorShm("unitfull", "gateway", 2, 64, 1)
    try:
        tensors = [pb.Tensor(name=str(i), datatype="FP32", raw=b"z" * 64) for i in range(3)]
        held = gw.stage_inputs(tensors)
        assert len(held) == 2 and tensors[2].raw == b"z" * 64
    finally:
        gw.close()


def test_reference_to_a_region_elsewhere_is_refused_not_local() -> None:
    t = pb.Tensor(name="x", datatype="FP32", parts=[pb.TensorPart(region="stageserve-x-gw-1")])
    with pytest.raises(RegionNotLocal, match="not on this host"):
        tensor_bytes(t)


def test_only_models_whose_every_instance_is_local_use_shared_memory() -> None:
    def inst(model: str, worker: str) -> pb.InstanceInfo:
        return pb.InstanceInfo(model=model, worker_id=worker)

    instances = [inst("a", "w1"), inst("b", "w1"), inst("b", "w2"), inst("c", "w3")]
    hosts = {"w1": "here", "w2": "there"}  # w3 announced no region
    assert local_models("here", instances, hosts) == {"a"}
    assert local_models("there", instances, hosts) == set()


def test_bench_tensor_shm_cost_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """bench.tensor_shm_cost (the inline-threshold measurement) runs and prints a row a size."""
    from bench import tensor_shm_cost

    assert tensor_shm_cost.main(["--repeat", "5", "--rounds", "1", "--sizes", "1024", "65536"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [r.split()[0] for r in rows] == ["1024", "65536"]


def test_worker_writes_a_numeric_output_straight_into_its_region() -> None:
    wk = TensorShm("unitarr", "worker", 4, 256, 64)
    try:
        arr = np.arange(40, dtype=np.float32).reshape(2, 20)[:, ::2]  # not contiguous
        t = pb.Tensor(name="o", datatype="FP32", shape=list(arr.shape))
        assert wk.put_array(t, arr, os.getpid())
        assert bytes(tensor_bytes(t)) == np.ascontiguousarray(arr).tobytes()
        assert not wk.put_array(pb.Tensor(), arr[:, :2], 1)  # under the threshold
        assert not wk.put_array(pb.Tensor(), arr.astype(">f4"), 1)  # not the raw byte order
        request = pb.ExecuteRequest(shm_hosts=[wk.host, "x/y"], shm_pids=[5, 6])
        assert [wk.consumer(request, i) for i in range(3)] == [5, 0, 0]
    finally:
        wk.close()


def test_full_region_reclaims_what_dead_consumers_held() -> None:
    wk = TensorShm("unitreclaim", "worker", 2, 64, 1)
    try:
        dead = _dead_pid()
        for _ in range(2):  # outputs for a gateway that was killed before taking them
            assert wk.put_array(pb.Tensor(), np.zeros(16, np.float32), dead)
        assert wk.in_use() == 2
        t = pb.Tensor(name="x", datatype="FP32", raw=b"y" * 64)
        assert wk.stage_inputs([t]) and t.parts  # the full region reclaimed both, took one
        assert wk.in_use() == 1
    finally:
        wk.close()
