"""Objects a stage keeps for its whole life, moved out of the cyclic
collector's reach.

CPython's collector walks every tracked object of a generation it collects;
its oldest generation holds what a stage built at start (grpc, protobuf,
numpy, the backends' modules, the model tables): 66,000-160,000 objects in
the gateway, scheduler and worker. Each full collection of those took 30-41
ms on the 2-core VM, every few seconds under load, with the stage's event
loop stopped meanwhile: the p99 tail of ~1 % of requests at 30-55 ms that
perf_analyzer showed at c=8 and c=32 (gc.callbacks timing every collection
of each stage during `python -m bench`).

`settle()` collects once, then freezes what is left (gc.freeze: the
collector never looks at those objects again; reference counting still
frees them). Later full collections walk only what the stage built since.
Each stage settles when it is ready; a worker settles again after its model
set changed (a model's objects are built at load). Unfreezing first makes
a settle look at everything once more, so the objects of unloaded models
that only the collector can free (reference cycles) are not kept frozen.

Measured A/B, three interleaved rounds (docs/benchmarks.md "Full
collections and the p99 tail"): p99 without / with, accumulator c=8
8.5-9.4 / 6.6-8.8 ms, c=32 29.8-43.0 / 17.4-42.3 ms; simple c=8 9.0-9.5 /
6.3-7.5 ms, c=32 18.9-30.7 / 11.9-17.8 ms. Throughput and CPU per
inference within noise: the full collections were ~1 % of the CPU. Young
collections stay as CPython sets them: raising the first threshold to
20,000 made each one walk ~20,000 objects (8 ms, the same total CPU), most
of them garbage in reference cycles that only the collector frees.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def settle(why: str) -> None:
    """Collect everything once, then freeze what is alive (see above)."""
    start = time.perf_counter()
    gc.unfreeze()
    collected = gc.collect()
    gc.freeze()
    log.info(
        "heap settled",
        extra={
            "why": why,
            "frozen": gc.get_freeze_count(),
            "collected": collected,
            "ms": round((time.perf_counter() - start) * 1000, 1),
        },
    )
