"""Which gRPC core I/O path StageServe's service processes use.

grpcio 1.85 runs its client and listener sockets on the EventEngine by
default. Turning those two experiments off puts them back on the older iomgr
path, which costs less CPU per stream message in these processes:

- bench.transport (one StreamLink echo, 2 s per point, same run): 3,007 ->
  4,430 calls/s at 1 in flight (client 185 -> 130 us, server 167 -> 123 us CPU
  per call), 10,550 -> 15,199 at 4 in flight (55/46 -> 40/35 us).
- The whole stack, `python -m bench --models simple`, two interleaved rounds:
  c=1 467/479 -> 522/547 infer/s (p50 2.04-2.07 -> 1.75-1.80 ms), c=8
  1,394/1,495 -> 1,487/1,560, c=64 1,593/1,665 -> 1,673/1,680; gateway CPU
  per request at c=64 485-495 -> 467-469 us, worker at c=1 494-509 -> 419-428.
  py-spy --native had shown eventfd_write (waking the EventEngine's poller)
  in 20% of the gateway's on-CPU samples.

It must be chosen before grpc is first imported (grpc reads GRPC_EXPERIMENTS
once), so `stageserve` service processes call this first thing; a value the
user set in the environment wins.
"""

from __future__ import annotations

import os

GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def choose_grpc_io(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """Set GRPC_EXPERIMENTS unless the user did; returns the value in force."""
    return environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)
