"""One typed settings tree per process: a section per service plus shared ones.

Leases, heartbeats, timeouts, retry and backoff figures, and the service
flags that tune behaviour (rate limiting, the adaptive batch hold, model
control), are defined here, once, with why each has its value. A numeric
field (or a text field, from its choices) can be set from the environment as
STAGESERVE_<SECTION>_<FIELD> (e.g. STAGESERVE_WORKER_LEASE_MS=5000), which is
how compose and Kubernetes configure the stages; a field marked `flag(...)` is
set by that `stageserve` command-line flag (its default here is the flag's
default), and by the environment only where it names its own variable. Two
sections have their own readers, under the variable names deployments use:
the mutual TLS between stages (``stage_tls``, STAGESERVE_STAGE_TLS_*, its
files read here, once: stageserve/stage_tls.py) and grpc's I/O path
(``grpc_io``, GRPC_EXPERIMENTS: stageserve/grpc_io.py).
`stageserve` builds the tree once at startup (settings_from) and hands it to
the service it runs, as vLLM hands its config tree down; services read it,
never module constants. docs/deployment.md lists the fields.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from stageserve import grpc_io, stage_tls
from stageserve.autocomplete_options import TRITON_DEFAULT, AutoComplete
from stageserve.cache_options import CacheConfig
from stageserve.grpc_io import GrpcIo
from stageserve.security_options import Restriction, TlsOptions
from stageserve.stage_tls import StageTls
from stageserve.triton_flags import DEFAULT_EXIT_TIMEOUT_S

T = TypeVar("T")


def read_by(reader: Callable[[Mapping[str, str]], Any], **kwargs: Any) -> Any:
    """A section built from the environment by its own `reader` (not
    STAGESERVE_<SECTION>_<FIELD> figures)."""
    return field(metadata={"read": reader}, **kwargs)


def one_of(default: str, *others: str) -> Any:
    """A text field set from the environment to `default` or one of `others`."""
    return field(default=default, metadata={"choices": (default, *others)})


def flag(default: Any, dest: str, env: str | None = None) -> Any:
    """A field set by the command-line flag whose argparse dest is `dest`
    (when the flag was given: None means not given); else, with `env`, by
    that environment variable."""
    return field(default=default, metadata={"flag": dest, "env": env})


@dataclass(frozen=True)
class WorkerSettings:
    # Liveness lease in the registry: a killed worker's instances stop being
    # granted at most this long after its last heartbeat (sooner when a
    # scheduler sees its stream break).
    lease_ms: int = 3000
    # Heartbeat period; also how soon a worker the rate limiter forgot (Redis
    # restarted empty) registers its instances again.
    heartbeat_s: float = 0.5
    # Re-check of the published model set when no model event arrives.
    reconcile_s: float = 2.0
    # How long a worker unloads nothing while a gateway it saw has no
    # publication mark (Redis lost it, or the gateway is gone): a live gateway
    # marks again within its republish check (0.25 s); only a gone one's
    # absence lasts, and it delays unloads by this much (services/worker/publishers.py).
    publisher_grace_s: float = 5.0
    # How long a Python model's BLS keeps a called model's config: a reload is
    # picked up within this (the scheduler checks generations too).
    bls_model_cache_s: float = 1.0
    # Threads numpy's BLAS may use in the worker process (Python-backend
    # models' numpy). 1: idle OpenBLAS threads busy-wait on the cores the
    # other stages need (services/worker/blas_threads.py has the figures);
    # 0 keeps the library's default. OPENBLAS/MKL/OMP_NUM_THREADS set in the
    # worker's environment win.
    blas_threads: int = 1
    # 1: every Python-backend model's instance runs in its own stub process,
    # as in Triton (a model's parameter STAGESERVE_INSTANCE_PROCESS decides
    # for that model). 0, the default: on a thread of the worker, which
    # costs less per batch (python_backend/process_instance.py, docs/python_backend.md).
    python_instance_process: int = 0
    # auto | cpu | cuda:N: where this worker's instances run.
    device: str = flag("auto", "device")
    # How the worker's threads wait for their GPU (services/worker/cuda_sync.py):
    # auto (CUDA's default: spin while contexts <= cores), spin, yield, blocking.
    # The spin is most of the worker's CPU per request on the H100 host; auto
    # stays the default until a GPU host has measured blocking against it.
    cuda_sync: str = one_of("auto", "spin", "yield", "blocking")
    # The server of the worker's internal port (the schedulers' batch
    # streams): StageServe's own HTTP/2 server (stageserve/h2grpc/), or
    # grpc.aio's. The first costs the worker about half as much per stream
    # message (docs/benchmarks.md, "The worker's stream on the own HTTP/2
    # server"); grpcio stays selectable for comparison.
    grpc_server: str = one_of("h2", "grpcio")


@dataclass(frozen=True)
class SchedulerSettings:
    # Lease of a grant; a crashed scheduler's grants come free this long
    # after their last renewal.
    grant_lease_ms: int = 2000
    # Renewal period of held grants; also how soon grants lost with Redis
    # are noticed.
    grant_renew_s: float = 0.5
    # How long one Acquire waits for a busy instance before asking again.
    acquire_wait_ms: int = 500
    # Liveness of a scheduler's sequence backlog entries: a dead scheduler's
    # entries stop blocking their sequences after this.
    sequence_owner_ttl_ms: int = 3000
    # Sequences whose last committed states a scheduler keeps per model, to
    # run their next request without the backlog listing and claim (two of a
    # request's three Redis calls; services/scheduler/sequence_cache.py).
    # Each holds its states' bytes. 0: every request lists and claims (a
    # START too).
    sequence_cache_entries: int = 10_000
    # A batch with no answer from its worker within this fails
    # DEADLINE_EXCEEDED (a hung model.py; a dead worker fails at once).
    execute_timeout_s: float = 300.0
    # A grant held while its queue has work goes back after this, so other
    # schedulers get a turn at the instance.
    grant_reuse_s: float = 2.0
    # An idle queue keeps its grants this long for the next burst.
    standby_hold_s: float = 0.5
    # The adaptive hold's cap, on by default (services/scheduler/hold_tuner.py):
    # with the tuner, two interleaved A/B rounds on the 2-core dev machine gave
    # +11-20% at concurrency 32-64 (identity, mlp), 0.98-1.03x at 1 and 8, and
    # 19% less CPU per inference at 64 (docs/benchmarks.md). 0: off, Triton's
    # batching exactly. STAGESERVE_ADAPTIVE_BATCH_DELAY_US sets it when the flag
    # is not given (in `stageserve up`'s environment, for its scheduler).
    adaptive_batch_delay_us: int = flag(
        2000, "adaptive_batch_delay_us", env="STAGESERVE_ADAPTIVE_BATCH_DELAY_US"
    )
    # Sharding by model (services/scheduler/shard_member.py): a scheduler that
    # stops renewing its lease loses its models this long after its last
    # renewal; renewed every shard_heartbeat_s. A dead scheduler's models
    # move within lease + heartbeat (3.5 s, inside the 5 s the stack promises).
    # 0: this scheduler stays out of the shard map and queues every model sent
    # to it (gateways that see no scheduler in the map use their --scheduler).
    shard_lease_ms: int = 3000
    shard_heartbeat_s: float = 0.5
    # The server of the scheduler's internal port (the gateways' request
    # streams, BLS calls, queue statistics): StageServe's own HTTP/2 server
    # (stageserve/h2grpc/), or grpc.aio's, as the worker's (WorkerSettings.grpc_server).
    grpc_server: str = one_of("h2", "grpcio")
    # The client of the scheduler's streams to the workers and the rate
    # limiter: StageServe's own (stageserve/h2grpc/client.py) or grpc.aio's.
    # The first costs about half as much per stream message (docs/benchmarks.md,
    # "The internal streams on the own HTTP/2 client"); grpcio stays selectable.
    stream_client: str = one_of("h2", "grpcio")
    # Triton's --cache-config (stageserve/cache_options.py), as the gateways
    # have it: the response cache of the composing models of an ensemble
    # (services/scheduler/step_cache.py); None: ensemble steps always run.
    response_cache: CacheConfig | None = flag(None, "cache_config")


@dataclass(frozen=True)
class RateLimiterSettings:
    # A waiting Acquire re-checks Redis at least this often. Releases wake it
    # at once (its own process's directly, another rate limiter's through
    # Redis pub/sub; so are registrations), so this only bounds what nothing
    # signals: a lost pub/sub message, Redis away. Polling at 0.02 s without
    # those signals was 22% of the rate limiter's samples at c=64 (profile),
    # an Acquire that waits out its 500 ms behind a grant the scheduler
    # reuses polling 25 times.
    acquire_poll_s: float = 0.25
    # A pool that waits for another pool's lower scaled priority re-checks
    # this often (the other pool's demand lapses unannounced).
    deferred_poll_s: float = 0.02
    # Period of releasing expired grants and forgetting dead workers: with
    # the leases, bounds how long a crashed holder keeps resources.
    sweep_s: float = 0.25
    # Period of exporting resource and instance gauges for /metrics.
    usage_export_s: float = 1.0
    # Leases applied when a caller sends none (lease_ms 0).
    default_worker_lease_ms: int = 3000
    default_grant_lease_ms: int = 60_000
    default_renew_lease_ms: int = 5000
    # Triton's --rate-limit: off (one payload per instance, resources ignored)
    # or execution_count (instances run only while holding their resources);
    # services/ratelimiter/options.py parses it.
    mode: str = flag("off", "rate_limit")
    # --rate-limit-resource overrides: field ("name" or "name@device") -> count.
    resources: tuple[tuple[str, int], ...] = flag((), "rate_limit_resources")
    # The server of the rate limiter's port (the schedulers' grant streams,
    # the workers' registrations): StageServe's own HTTP/2 server, or
    # grpc.aio's, as the worker's (WorkerSettings.grpc_server).
    grpc_server: str = one_of("h2", "grpcio")


@dataclass(frozen=True)
class GatewaySettings:
    # A request waits at most this long for the scheduler connection before
    # it fails UNAVAILABLE (a restarted scheduler is usually back in ~1-2 s).
    scheduler_connect_timeout_s: float = 5.0
    # A model load fails when no worker loaded an instance within this.
    load_timeout_s: float = 120.0
    # Period of publishing this gateway's statistics for the others.
    stats_publish_s: float = 1.0
    # Period of checking that Redis still holds the model set (the gateway's
    # publication mark, renewed by the same check).
    republish_check_s: float = 0.25
    # Lease of that mark: a killed gateway's mark is gone after this, a
    # gateway stalled this long republishes (records Redis still holds are kept).
    publication_lease_ms: int = 3000
    # Longest wait of a write on the stream to the scheduler for more requests,
    # under load and while it pays (stageserve/write_hold.py); 0: write at once.
    scheduler_link_hold_us: int = 2000
    # none | explicit | poll, as Triton's --model-control-mode.
    model_control_mode: str = flag("none", "model_control_mode")
    # With poll: seconds between repository scans (--repository-poll-secs).
    repository_poll_secs: float = flag(15.0, "repository_poll_secs")
    # Triton's --disable-auto-complete-config and --default-max-batch-size.
    autocomplete: AutoComplete = flag(TRITON_DEFAULT, "autocomplete")
    # The public endpoints' security, Triton's flags (stageserve/security_options.py):
    # TLS on the gRPC front (--grpc-use-ssl ...; None: plaintext) and the
    # protocol groups that need a header (--grpc-restricted-protocol,
    # --http-restricted-api).
    public_tls: TlsOptions | None = flag(None, "public_tls")
    grpc_restrictions: tuple[Restriction, ...] = flag((), "grpc_restrictions")
    http_restrictions: tuple[Restriction, ...] = flag((), "http_restrictions")
    # Triton's --exit-on-error and --strict-readiness, with Triton's defaults
    # (services/gateway/startup.py): a startup model that fails to load ends the
    # gateway with status 1; ServerReady waits for every model, not only liveness.
    exit_on_error: bool = flag(True, "exit_on_error")
    strict_readiness: bool = flag(True, "strict_readiness")
    # Triton's --grpc-header-forward-pattern / --http-header-forward-pattern:
    # matching request headers become string parameters of the request
    # (services/gateway/header_forward.py); None: none forwarded.
    grpc_header_forward_pattern: str | None = flag(None, "grpc_header_forward_pattern")
    http_header_forward_pattern: str | None = flag(None, "http_header_forward_pattern")
    # Triton's --grpc-max-connection-age / -grace (ms; None: unset): a client
    # connection older than that is ended (GOAWAY) once its calls finish, the
    # grace bounding how long they may take (grpc's channel arguments).
    grpc_max_connection_age_ms: int | None = flag(None, "grpc_max_connection_age")
    grpc_max_connection_age_grace_ms: int | None = flag(None, "grpc_max_connection_age_grace")
    # Triton's --model-load-retry-count: a load whose instances failed is
    # published again (a new generation) this many more times before it fails.
    model_load_retry_count: int = flag(0, "model_load_retry_count")
    # Triton's --grpc-infer-response-compression-level: the gRPC front's
    # ModelInfer / ModelStreamInfer answers compressed as Triton does
    # (stageserve/h2grpc/wire.py response_encoding); "none": uncompressed.
    grpc_infer_response_compression: str = flag("none", "grpc_infer_response_compression_level")
    # Triton's --metrics-address: what the Triton metrics port binds.
    metrics_address: str = flag("0.0.0.0", "metrics_address")
    # Triton's --model-config-name: a model's configs/<name>.pbtxt is read
    # instead of its config.pbtxt where it has one (stageserve/config.py).
    model_config_name: str | None = flag(None, "model_config_name")
    # What ServerMetadata answers (--server-name): Triton's name by default, as
    # Triton's client examples check it.
    server_name: str = flag("triton", "server_name")
    # Triton's --exit-timeout-secs: on shutdown, how long the gateway waits for
    # requests in flight (stageserve/triton_flags.py says why 5, not Triton's 30).
    exit_timeout_secs: int = flag(DEFAULT_EXIT_TIMEOUT_S, "exit_timeout_secs")
    # The embedded server of the HTTP front: uvicorn, or granian's experimental
    # embedded mode, kept for the comparison in docs/benchmarks.md
    # (services/gateway/http/server.py says why uvicorn is the default).
    http_server: str = one_of("uvicorn", "granian")
    # The server of the public gRPC front: StageServe's own HTTP/2 server
    # (stageserve/h2grpc/), or grpcio's grpc.aio server. The first answers a
    # unary call for ~50-85 us of CPU against grpc.aio's ~290-370 on the 2-core
    # development VM (docs/benchmarks.md, "The public gRPC front on its own
    # HTTP/2 server"); grpcio stays selectable for comparison.
    grpc_server: str = one_of("h2", "grpcio")
    # The client of the streams to the schedulers (a gateway's, a worker's BLS
    # calls, a scheduler's to its peers), as SchedulerSettings.stream_client.
    stream_client: str = one_of("h2", "grpcio")
    # Triton's --cache-config (stageserve/cache_options.py): the response cache
    # of the models that enable one; None: nothing cached, as Triton without it.
    response_cache: CacheConfig | None = flag(None, "cache_config")
    # Triton's --trace-config, as given (stageserve/tracing.py parses it): the
    # stack's startup trace settings, seeded in Redis by the first gateway.
    trace_config: tuple[str, ...] = flag((), "trace_config")
    # Triton's --reuse-grpc-port / --reuse-http-port: bind the public port with
    # SO_REUSEPORT, so several gateway processes share it and the kernel
    # spreads new connections over them (`stageserve up --gateways N` sets
    # both). Off by default, as in Triton: a port already taken fails the bind.
    reuse_grpc_port: bool = flag(False, "reuse_grpc_port")
    reuse_http_port: bool = flag(False, "reuse_http_port")
    # A request's shared-memory input reads, and apart from them its output
    # writes, that total more bytes than this run on a thread (copies that
    # release the GIL: services/gateway/shm_copies.py), not on the event loop
    # every request to this gateway waits on. Measured on the 2-core
    # development VM: a 1 MiB copy costs the loop 25-165 us into memory the
    # process reuses, 0.8-1.1 ms into fresh pages; 64 MB took 45 ms to read
    # and 6-9 ms to write. The hop to a thread costs the loop 30 us (the
    # request 53 us), so below 1 MiB it would cost about what it saves.
    shm_copy_thread_bytes: int = 1 << 20
    # The threads those copies run on: their own, so a burst of copies neither
    # waits behind nor delays model loads and repository scans (asyncio's
    # default executor); as many as the cores a gateway is sized for
    # (stack.auto_gateway_cores): more would only share those cores.
    shm_copy_threads: int = 4


@dataclass(frozen=True)
class RedisClientSettings:
    # Retries of a command whose connection broke (a stale pooled connection
    # after Redis restarted), with exponential backoff from base to cap: short,
    # so callers still fail fast while Redis is really down.
    retries: int = 3
    backoff_base_s: float = 0.02
    backoff_cap_s: float = 0.1


@dataclass(frozen=True)
class SupervisorSettings:
    # `stageserve up`'s restarts: first delay, doubling up to the cap while
    # a stage keeps failing; a stage up this long counts as healthy again.
    restart_first_delay_s: float = 0.1
    restart_max_delay_s: float = 5.0
    restart_healthy_after_s: float = 10.0
    # A restarted stage that does not announce itself by then is killed and retried.
    start_timeout_s: float = 120.0


@dataclass(frozen=True)
class StackSettings:
    # `stageserve up --gateways auto`: one gateway per this many cores the
    # launcher may use (sched_getaffinity), at least 1, at most
    # auto_gateways_max (stageserve/scale_out.py). Measured on an H100 host
    # with 16 cores (docs/benchmarks.md, "On an H100 host, 2026-11-27"):
    # bench.scale identity c=256 gave 9,885-9,904 infer/s with 4 gateways
    # (4.6 gateway cores) and 12,368 with 8 (6.5 gateway cores); bench.gpu's
    # CNN (49 KB inputs) 8,341-9,183 with 6 gateways and 9,492-9,692 with 8,
    # every gateway near a full core. A gateway then costs ~0.5-0.8 ms of CPU
    # per request, mostly grpcio's own code, so the gateways bind first and
    # take about half the cores; the model's one scheduler binds next (~1
    # core at ~10,000-12,000 infer/s). On 2 cores a second gateway competes
    # with the scheduler and worker for the same cores: bench.scale, identity
    # c=32, two rounds, gave no throughput gain and more CPU per inference
    # (gateways ~425 -> ~630 us, scheduler ~167 -> ~248, worker ~118 -> ~168),
    # so auto is 1 there. GPUs do not enter: the gateway's work (protocol,
    # tensors in and out) is CPU work.
    auto_gateway_cores: int = 2
    auto_gateways_max: int = 8
    # Tensor bytes through shared memory between a gateway and the workers on
    # its host (stageserve/tensor_shm.py): 1 on (the default), 0 off (every
    # tensor inline on the streams). Each gateway and worker owns a region of
    # tensor_shm_slots x tensor_shm_slot_bytes under /dev/shm, reserved when
    # the process starts (32 MiB by default; a /dev/shm without room: that
    # process goes without, inline). A worker on another host or container
    # gets inline bytes; a full region is back-pressure, also inline. A
    # tensor smaller than tensor_shm_min_bytes stays inline: for it the slot
    # alloc, the region write and the free outweigh the stream copies saved.
    # bench.tensor_shm_cost puts the crossover at ~32-48 KB in one process,
    # the stack's gRPC framing and socket copies of every inline byte move it
    # lower: 16 KiB (docs/benchmarks.md, "Tensor bytes through shared memory").
    tensor_shm: int = 1
    tensor_shm_min_bytes: int = 16384
    tensor_shm_slots: int = 512
    tensor_shm_slot_bytes: int = 65536
    # The event loop every stage runs on (stageserve/event_loop.py): uvloop
    # (its socket and callback handling in C) or asyncio's. Interleaved on
    # the 2-core VM, bench.scale identity c=256: 5,863-5,943 -> 6,373-6,612
    # infer/s, gateway 124-127 -> 112-115 us, scheduler 37-38 -> 32-35 us
    # per inference (docs/benchmarks.md, "The stages on uvloop"). Without
    # uvloop installed a stage warns and runs on asyncio's.
    event_loop: str = one_of("uvloop", "asyncio")


def from_env(cls: type[T], service: str, environ: Mapping[str, str] = os.environ) -> T:
    """cls's defaults, each overridden by STAGESERVE_<SERVICE>_<FIELD> when set
    (a flag field by its own variable, if it has one): a number, or for a text
    field one of its choices."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if "flag" in f.metadata:
            if f.metadata["env"] is None:
                continue
            name = f.metadata["env"]
        else:
            name = f"STAGESERVE_{service.upper()}_{f.name.upper()}"
        raw = environ.get(name)
        if raw is None:
            continue
        if "choices" in f.metadata:
            if raw not in f.metadata["choices"]:
                expected = " or ".join(f.metadata["choices"])
                raise ValueError(f"{name}={raw!r}: expected {expected}")
            values[f.name] = raw
            continue
        kind = int if f.type in (int, "int") else float
        try:
            value = kind(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r}: expected {kind.__name__}") from None
        if value < 0:
            raise ValueError(f"{name}={raw!r}: must not be negative")
        values[f.name] = value
    return cls(**values)


@dataclass(frozen=True)
class Settings:
    """The tree one process is handed: every service's section (a process runs
    one service, but `up` supervises them all and tests read the figures) and
    the shared ones."""

    gateway: GatewaySettings = field(default_factory=GatewaySettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    ratelimiter: RateLimiterSettings = field(default_factory=RateLimiterSettings)
    worker: WorkerSettings = field(default_factory=WorkerSettings)
    redis_client: RedisClientSettings = field(default_factory=RedisClientSettings)
    supervisor: SupervisorSettings = field(default_factory=SupervisorSettings)
    stack: StackSettings = field(default_factory=StackSettings)
    # Mutual TLS between the stages: the PEM contents every internal channel
    # presents and every internal port requires; None: plaintext. Handed to
    # the code that dials or listens (stageserve/net.py).
    stage_tls: StageTls | None = read_by(stage_tls.from_environ, default=None)
    # grpc's I/O path; stageserve/grpc_io.py says why it is also written to the
    # environment before grpc is imported.
    grpc_io: GrpcIo = read_by(grpc_io.from_environ, default_factory=GrpcIo)


# section name -> its class, for the sections of STAGESERVE_<SECTION>_<FIELD>
# figures and flag fields (each such Settings field's default factory)
_SECTIONS: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in dataclasses.fields(Settings)
    if "read" not in f.metadata
}
# section name -> its own reader of the environment
_READ: dict[str, Callable[[Mapping[str, str]], Any]] = {
    f.name: f.metadata["read"] for f in dataclasses.fields(Settings) if "read" in f.metadata
}


def settings_from_env(environ: Mapping[str, str] = os.environ) -> Settings:
    """Every section's defaults overridden by the environment; ValueError names
    a malformed or negative variable, StageTlsError (a ValueError) an
    incomplete stage TLS or a certificate file it cannot read."""
    sections: dict[str, Any] = {name: read(environ) for name, read in _READ.items()}
    for name, cls in _SECTIONS.items():
        sections[name] = from_env(cls, name, environ)
    return Settings(**sections)


def with_flags(settings: Settings, flags: argparse.Namespace | Mapping[str, Any]) -> Settings:
    """`settings` with each flag field replaced by its parsed flag (a dest absent
    from `flags`, as another service's flags are, or None leaves the default)."""
    given = vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags)
    sections = {}
    for name in _SECTIONS:
        section = getattr(settings, name)
        changes = {
            f.name: given[f.metadata["flag"]]
            for f in dataclasses.fields(section)
            if "flag" in f.metadata and given.get(f.metadata["flag"]) is not None
        }
        sections[name] = dataclasses.replace(section, **changes)
    return dataclasses.replace(settings, **sections)


def settings_from(
    flags: argparse.Namespace | Mapping[str, Any], environ: Mapping[str, str] = os.environ
) -> Settings:
    """The tree a `stageserve` process runs with: the environment's figures and its flags."""
    return with_flags(settings_from_env(environ), flags)
