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

The choice is a field of the settings tree (stageserve/settings.py, field
``grpc_io``), built from the environment like the rest: a GRPC_EXPERIMENTS the
user set wins, else the value above. grpc takes it from nowhere but the
environment, read once when its C core is first imported, so `stageserve`
builds the tree and writes the tree's value back to the environment
(`use_grpc_io`) before anything imports grpc; the children `stageserve up`
starts inherit the same value.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

ENV = "GRPC_EXPERIMENTS"
GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


@dataclass(frozen=True)
class GrpcIo:
    # grpc's experiments for this process: the iomgr path by default (the
    # module docstring has the figures).
    experiments: str = GRPC_EXPERIMENTS


def from_environ(environ: Mapping[str, str]) -> GrpcIo:
    """The user's GRPC_EXPERIMENTS when set (even empty: all of grpc's defaults), else ours."""
    value = environ.get(ENV)
    return GrpcIo() if value is None else GrpcIo(value)


def use_grpc_io(io: GrpcIo, environ: MutableMapping[str, str] = os.environ) -> None:
    """Write the tree's choice where grpc reads it. In this process's own
    environment, a RuntimeError when grpc was imported already with another
    value: the choice would silently not apply."""
    if environ is os.environ and "grpc" in sys.modules and environ.get(ENV) != io.experiments:
        raise RuntimeError(f"grpc was imported before {ENV}={io.experiments!r} could be set")
    environ[ENV] = io.experiments


def choose_grpc_io(environ: MutableMapping[str, str]) -> str:
    """For a child process's environment built outside a settings tree (the
    benchmarks): the same choice, written into `environ`; returns it."""
    io = from_environ(environ)
    use_grpc_io(io, environ)
    return io.experiments
