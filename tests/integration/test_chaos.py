"""bench.chaos in short: kill -9 each stage (Redis too) under tritonclient load.

The same code as `python -m bench.chaos`, with fewer clients and shorter
windows, guarding the benchmark's goals: for every stage, no hung call, no
wrong answer (simple's sums, accumulator's running sums and identity_fp32's
48 KiB tensors, which go through shared memory, are checked), no leak in
Redis afterwards (grants, instance counts, sequence keys) nor of a
shared-memory tensor slot once the load stopped, and the
service healed (its last second answers and fails nothing) within the
window, which goes on past WINDOW_S until then, up to HEAL_S (seen: a
worker's restart past 8 s with the suite on two processes and two CPU
burners on the 2 cores). The issue's goal, full throughput within
5 s of the kill, is a figure of `python -m bench.chaos` (measured 0.0-2.0 s
per stage, 2-core machine, load average ~3), not asserted here: with the
cores busy elsewhere one stage took 6.2 s once. The table is printed.
"""

from __future__ import annotations

from pathlib import Path

from bench.chaos import EXTRA_STAGES, STAGES, run_chaos, table

WINDOW_S = 8.0
HEAL_S = 30.0


def test_every_stage_killed_heals_without_hangs_wrong_answers_or_leaks(
    example_repository: Path,
) -> None:
    run = run_chaos(
        example_repository,
        STAGES,
        clients=4,
        baseline_s=1.0,
        window_s=WINDOW_S,
        settle_s=1.5,
        heal_s=HEAL_S,
    )
    results = run.results
    print("\n" + table(results))
    print(f"tensor slots held after the load: {run.tensor_slots}")
    # Shared memory is on by default and one client sends 48 KiB tensors
    # through it: every slot of every live region is free again.
    assert run.tensor_slots == 0
    assert [r.stage for r in results] == list(STAGES)
    first_audit = results[0].audit
    assert first_audit is not None, results[0].stage
    for r in results:
        assert r.hung == 0, (r.stage, r.errors)
        assert r.wrong == 0, r.stage
        assert r.python_text == 0, r.stage
        assert r.audit is not None, r.stage
        assert r.leaked == 0, (r.stage, r.audit.problems)
        assert r.ok > 0, r.stage
        # Healed within the window (at most HEAL_S): the last second answers,
        # and fails none.
        # Full throughput (r.full_s) is the benchmark's figure: it compares
        # with the second before the kill, which a busy machine can skew
        # either way (seen: never back to 90% of a 643 req/s second with
        # other runs on the 2 cores, while 2,736 calls succeeded, 4 failed).
        assert r.ok_last_s > 0 and r.failed_last_s == 0, (r.stage, r.errors)
        # Every registered instance came back (the worker's after its restart).
        assert r.audit.instances == first_audit.instances > 0


def test_one_of_two_gateways_and_one_of_two_schedulers_killed(example_repository: Path) -> None:
    """`--gateways 2 --schedulers 2`: kill -9 of the second gateway (clients
    reconnect to the first while the supervisor restarts it) and of the
    second scheduler (its models move to the first within seconds): no hung
    call, no wrong answer, no leak, healed."""
    run = run_chaos(
        example_repository,
        EXTRA_STAGES,
        clients=4,
        baseline_s=1.0,
        window_s=WINDOW_S,
        settle_s=1.5,
        heal_s=HEAL_S,
        gateways=2,
        schedulers=2,
    )
    print("\n" + table(run.results))
    print({r.stage: r.errors for r in run.results})
    assert run.tensor_slots == 0
    assert [r.stage for r in run.results] == list(EXTRA_STAGES)
    for r in run.results:
        assert r.hung == 0 and r.wrong == 0 and r.python_text == 0, (r.stage, r.errors)
        assert r.audit is not None and r.leaked == 0, (r.stage, r.audit and r.audit.problems)
        assert r.ok > 0 and r.ok_last_s > 0 and r.failed_last_s == 0, (r.stage, r.errors)
