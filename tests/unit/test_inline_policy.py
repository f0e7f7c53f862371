"""The worker's choice between running a batch inline and on the instance thread."""

from services.worker.inline_policy import INLINE_LIMIT_NS, InlinePolicy


def test_first_batch_goes_to_the_thread_until_the_model_was_timed() -> None:
    assert not InlinePolicy().runs_inline(executing_on_worker=0)


def test_fast_model_runs_inline_when_nothing_else_executes() -> None:
    policy = InlinePolicy()
    policy.observe(30_000)
    assert policy.runs_inline(executing_on_worker=0)


def test_never_inline_while_another_batch_executes_on_the_worker() -> None:
    policy = InlinePolicy()
    policy.observe(30_000)
    assert not policy.runs_inline(executing_on_worker=1)
    assert not policy.runs_inline(executing_on_worker=3)


def test_slow_model_stays_on_its_thread() -> None:
    policy = InlinePolicy()
    policy.observe(INLINE_LIMIT_NS)
    assert not policy.runs_inline(executing_on_worker=0)
    policy.observe(5 * INLINE_LIMIT_NS)
    assert not policy.runs_inline(executing_on_worker=0)


def test_running_mean_follows_a_model_that_slows_down_and_recovers() -> None:
    policy = InlinePolicy()
    policy.observe(10_000)
    for _ in range(20):  # e.g. much larger batches arrive
        policy.observe(2_000_000)
    assert not policy.runs_inline(executing_on_worker=0)
    for _ in range(40):
        policy.observe(10_000)
    assert policy.runs_inline(executing_on_worker=0)


def test_one_slow_outlier_does_not_flip_a_fast_model() -> None:
    policy = InlinePolicy()
    for _ in range(10):
        policy.observe(20_000)
    policy.observe(400_000)  # 0.2 weight: mean ~ 96 µs, still under the limit
    assert policy.runs_inline(executing_on_worker=0)
