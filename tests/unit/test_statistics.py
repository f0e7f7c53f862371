"""stageserve/statistics.py: Triton's ModelStatistics bookkeeping."""

from __future__ import annotations

import time

from stageserve.generated import grpc_service_pb2 as gs
from stageserve.generated import stageserve_pb2 as pb
from stageserve.statistics import Duration, ModelVersionStats, StatsBook, merge


def timing(batch_size, leader, queue=10, cin=20, cinfer=30, cout=40):
    return pb.Timing(
        queue_ns=queue,
        compute_input_ns=cin,
        compute_infer_ns=cinfer,
        compute_output_ns=cout,
        batch_size=batch_size,
        batch_leader=leader,
    )


def record_batch(stats, request_batch_sizes, **t):
    """One execution: every request of the batch is recorded, the first is the leader."""
    total = sum(request_batch_sizes)
    for i, n in enumerate(request_batch_sizes):
        stats.record_success(1000 + i, n, timing(total, i == 0, **t))


def test_duration_add_and_clamp():
    d = Duration()
    d.add(5)
    d.add(-7)  # a clock step back never subtracts
    d.add(10, count=3)
    assert (d.count, d.ns) == (5, 15)
    assert d.to_pb() == gs.StatisticDuration(count=5, ns=15)


def test_fresh_stats_are_zero():
    s = ModelVersionStats()
    p = s.to_pb("m", 1)
    assert p.name == "m" and p.version == "1"
    assert p.inference_count == p.execution_count == p.last_inference == 0
    assert p.inference_stats.success.count == 0 and p.inference_stats.fail.count == 0
    assert len(p.batch_stats) == 0


def test_batch_of_n_requests_counts_n_inferences_and_one_execution():
    s = ModelVersionStats()
    record_batch(s, [1, 1, 1, 1])
    assert s.inference_count == 4
    assert s.execution_count == 1
    assert s.success.count == 4
    assert s.queue.count == 4
    assert s.compute_infer.count == 4
    assert list(s.batches) == [4]
    assert s.batches[4].compute_infer.count == 1  # one execution of batch size 4


def test_multi_row_requests_count_rows():
    s = ModelVersionStats()
    record_batch(s, [3, 2])
    assert s.inference_count == 5
    assert s.execution_count == 1
    assert s.success.count == 2  # requests
    assert list(s.batches) == [5]


def test_non_batching_model_counts_one_per_request():
    s = ModelVersionStats()
    s.record_success(100, 0, timing(1, True))  # validated batch_size 0 = no batch dimension
    s.record_success(100, 0, timing(1, True))
    assert s.inference_count == 2
    assert s.execution_count == 2
    assert s.batches[1].compute_infer.count == 2


def test_only_leader_counts_execution_and_batch_stats():
    s = ModelVersionStats()
    s.record_success(50, 1, timing(8, False, cinfer=999))
    assert s.execution_count == 0
    assert s.batches == {}
    assert s.inference_count == 1
    assert s.compute_infer.ns == 999  # per-request compute stats still count


def test_durations_accumulate():
    s = ModelVersionStats()
    s.record_success(1000, 1, timing(2, True, queue=5, cin=6, cinfer=7, cout=8))
    s.record_success(3000, 1, timing(2, False, queue=50, cin=6, cinfer=7, cout=8))
    assert (s.success.count, s.success.ns) == (2, 4000)
    assert (s.queue.count, s.queue.ns) == (2, 55)
    assert (s.compute_input.count, s.compute_input.ns) == (2, 12)
    assert (s.compute_infer.count, s.compute_infer.ns) == (2, 14)
    assert (s.compute_output.count, s.compute_output.ns) == (2, 16)
    b = s.batches[2]
    assert (b.compute_input.count, b.compute_input.ns) == (1, 6)
    assert (b.compute_infer.count, b.compute_infer.ns) == (1, 7)
    assert (b.compute_output.count, b.compute_output.ns) == (1, 8)


def test_batch_stats_by_batch_size():
    s = ModelVersionStats()
    record_batch(s, [1, 1])
    record_batch(s, [4])
    record_batch(s, [1, 1])
    record_batch(s, [1])
    assert sorted(s.batches) == [1, 2, 4]
    assert s.batches[2].compute_infer.count == 2
    assert s.batches[4].compute_infer.count == 1
    assert s.batches[1].compute_infer.count == 1
    assert s.execution_count == 4
    assert s.inference_count == 2 + 4 + 2 + 1


def test_failures():
    s = ModelVersionStats()
    before = int(time.time() * 1000)
    s.record_failure(700)
    s.record_failure(300)
    assert (s.fail.count, s.fail.ns) == (2, 1000)
    assert s.success.count == 0
    assert s.inference_count == 0 and s.execution_count == 0
    assert s.queue.count == 0
    assert before <= s.last_inference_ms <= int(time.time() * 1000)


def test_last_inference_is_wall_clock_ms():
    s = ModelVersionStats()
    before = int(time.time() * 1000)
    s.record_success(1, 1, timing(1, True))
    assert before <= s.last_inference_ms <= int(time.time() * 1000)


def test_to_pb_fields():
    s = ModelVersionStats()
    record_batch(s, [1, 2], queue=11, cin=12, cinfer=13, cout=14)
    record_batch(s, [1], queue=1, cin=2, cinfer=3, cout=4)
    s.record_failure(99)
    p = s.to_pb("resnet", 3)
    assert isinstance(p, gs.ModelStatistics)
    assert p.name == "resnet"
    assert p.version == "3"
    assert p.last_inference == s.last_inference_ms > 0
    assert p.inference_count == 4
    assert p.execution_count == 2
    st = p.inference_stats
    assert (st.success.count, st.success.ns) == (3, 1000 + 1001 + 1000)
    assert (st.fail.count, st.fail.ns) == (1, 99)
    assert (st.queue.count, st.queue.ns) == (3, 23)
    assert (st.compute_input.count, st.compute_input.ns) == (3, 26)
    assert (st.compute_infer.count, st.compute_infer.ns) == (3, 29)
    assert (st.compute_output.count, st.compute_output.ns) == (3, 32)
    assert [b.batch_size for b in p.batch_stats] == [1, 3]  # sorted by size
    b1, b3 = p.batch_stats
    assert (b1.compute_infer.count, b1.compute_infer.ns) == (1, 3)
    assert (b3.compute_input.count, b3.compute_input.ns) == (1, 12)
    assert (b3.compute_infer.count, b3.compute_infer.ns) == (1, 13)
    assert (b3.compute_output.count, b3.compute_output.ns) == (1, 14)


def test_stats_book_per_model_version_and_reset():
    book = StatsBook()
    a1 = book.of("a", 1)
    assert book.of("a", 1) is a1
    a2, b1 = book.of("a", 2), book.of("b", 1)
    assert len({id(a1), id(a2), id(b1)}) == 3
    a1.record_failure(1)
    b1.record_failure(1)
    book.reset("a")
    assert book.of("a", 1) is not a1 and book.of("a", 1).fail.count == 0
    assert book.of("a", 2) is not a2
    assert book.of("b", 1) is b1 and b1.fail.count == 1
    book.reset("missing")  # harmless


def test_stats_book_starts_afresh_for_a_new_model_load():
    generation = {"m": 1}
    book = StatsBook(lambda model: generation.get(model, 0))
    record_batch(book.of("m", 1), [1])
    assert book.of("m", 1).inference_count == 1
    generation["m"] = 2  # the model was loaded again
    assert book.of("m", 1).inference_count == 0
    assert [(m, v, g) for m, v, g, _ in book.items()] == [("m", 1, 2)]


def test_merge_adds_up_gateways():
    a, b = ModelVersionStats(), ModelVersionStats()
    record_batch(a, [1, 1])  # one execution of batch 2
    record_batch(b, [1, 1])  # another of batch 2
    record_batch(b, [1])  # and one of batch 1
    b.record_failure(500)
    a.last_inference_ms, b.last_inference_ms = 10, 20
    total = merge([a.to_pb("m", 1), b.to_pb("m", 1)])
    assert (total.name, total.version) == ("m", "1")
    assert total.inference_count == 5 and total.execution_count == 3
    assert total.last_inference == 20
    s = total.inference_stats
    assert s.success.count == 5 and s.fail.count == 1 and s.fail.ns == 500
    assert s.queue.ns == 5 * 10 and s.compute_infer.ns == 5 * 30
    assert [(x.batch_size, x.compute_infer.count) for x in total.batch_stats] == [(1, 1), (2, 2)]
    assert total.batch_stats[1].compute_infer.ns == 60


def test_merge_of_one_is_itself():
    a = ModelVersionStats()
    record_batch(a, [1, 1, 1])
    assert merge([a.to_pb("m", 3)]) == a.to_pb("m", 3)
