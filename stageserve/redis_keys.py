"""Every Redis key StageServe uses, in one place.

Model state (written by the gateway, read by scheduler and worker):
  ss:models                   hash  model name -> generation
  ss:model:{name}             hash  config (serialized ModelConfig), versions
                                    ("1,2"), path, generation
  ss:model:{name}:errors      hash  "{version}@{worker}" -> load error text
  ss:models:events            pub/sub channel, message = model name
  ss:models:publishers        zset  gateway id -> until when (Redis time, ms) its
                                    publication mark holds; a gateway whose mark is
                                    gone (Redis lost its data) writes back the
                                    records of its models, then marks again;
                                    workers unload nothing while a gateway they
                                    saw has no mark (services/worker/publishers.py)

Statistics shared by the gateways (stageserve/shared_stats.py):
  ss:stats:{model}:g{gen}:v{ver}  hash  gateway id -> serialized ModelStatistics

Rate limiter registry and grants (ratelimiter only; see services/ratelimiter/lua.py):
  ss:rl:workers               set   worker ids
  ss:rl:worker:{wid}          str   worker address; PX lease = liveness
  ss:rl:worker:{wid}:insts    set   instance ids of that worker
  ss:rl:inst:{iid}            hash  model, version, kind, device_id, worker_id,
                                    worker_address
  ss:rl:pool:{model}:{ver}    set   registered instance ids
  ss:rl:free:{model}:{ver}    list  instance ids free to run a payload
  ss:rl:inst:{iid}  (also)    prio, need (JSON [[field, count, name, device]]),
                                    execs (grants so far, for scaled priority)
  ss:rl:grant:{gid}           hash  instance, model, version, need (what it took);
                                    gid "<scheduler id>/<incarnation>/<uuid>"
                                    ("<uuid>" for an acquire without a holder)
  ss:rl:grants                zset  grant id -> lease deadline (ms)
  ss:rl:res:cap               hash  resource field -> available count; a field
                                    is "{name}@global" or "{name}@{wid}/{device}"
  ss:rl:res:held              hash  resource field -> count held by grants
  ss:rl:res:override          hash  "name" / "name@device" -> --rate-limit-resource
  ss:rl:demand                zset  "{model}:{ver}" -> until when (ms) its last
                                    Acquire counts as waiting (priority picks)
  ss:rl:waiting:{model}:{ver} zset  rate limiter origin -> until when (ms) its last
                                    busy answer on the pool counts (WAITING_TTL_MS)
  ss:rl:waiting               zset  the same for any pool (freed resources)
  ss:rl:freed:{origin}        pub/sub channel: another rate limiter freed an
                                    instance ("{model}:{ver}") or anything ("*")

Sequence batcher (scheduler; see services/scheduler/sequence_store.py):
  ss:seq:{model}:{ver}:{cid}       hash  slot, st:{state} -> raw, sh:{state} -> shape;
                                         PX idle timeout
  ss:seq:{model}:{ver}:{cid}:q     list  backlog: "{owner}:{n}" per unfinished request,
                                         arrival order, head = the one allowed to run
  ss:seq-owner:{owner}             str   a scheduler's liveness (PX, heartbeated)

Log settings (LogSettings RPC, /v2/logging; see stageserve/log_follow.py):
  ss:log:settings             hash  setting name -> JSON value, the settings a
                                    gateway was asked to change; over each
                                    stage's own flags
  ss:log:events               pub/sub channel: the hash changed (message "1")

Response cache (gateways with --cache-config redis; stageserve/response_cache.py):
  ss:rc:e:{key}               str   a cached response (hex of the request key)
  ss:rc:recency               zset  key -> last use (ss:rc:clock), oldest evicted first
  ss:rc:sizes                 hash  key -> bytes of its entry
  ss:rc:bytes                 str   bytes held by every entry (kept under the budget)
  ss:rc:clock                 str   counter ordering uses

Tracing (stageserve/trace_store.py):
  ss:trace:state     str   the stack's trace settings (JSON: startup config, global, per model)
  ss:trace:counts    hash  setting uid -> traces it may still take (-1: unlimited)
  ss:trace:events    pub/sub channel: the settings changed

Schedulers sharded by model (stageserve/shard_map.py, shard_policy.py):
  ss:shard:members            zset  scheduler id -> lease deadline (Redis time, ms);
                                    renewed by its heartbeat, pruned once past
  ss:shard:addresses          hash  scheduler id -> address gateways and workers dial
  ss:shard:owners             hash  model name -> the scheduler id that owns its queues
  ss:shard:terms              hash  model name -> a token new with each owner (a take or
                                    a hand-over); the owner's sequence commits check it
  ss:shard:version            str   counter, bumped on every change of the three above
  ss:shard:events             pub/sub channel, message = the new version

Tensor bytes through shared memory (stageserve/tensor_shm.py):
  ss:tshm:hosts               hash  worker id -> the host id of a worker with a
                                    tensor region (gateways on that host send it
                                    references; services/gateway/tensor_transport.py)
"""

from __future__ import annotations

PREFIX = "ss:"

MODELS = PREFIX + "models"
MODEL_EVENTS = PREFIX + "models:events"
GENERATION_COUNTER = PREFIX + "models:generation"
MODEL_PUBLISHERS = PREFIX + "models:publishers"
RL_PREFIX = PREFIX + "rl:"
LOG_SETTINGS = PREFIX + "log:settings"
LOG_EVENTS = PREFIX + "log:events"

CACHE_ENTRY_PREFIX = PREFIX + "rc:e:"
CACHE_RECENCY = PREFIX + "rc:recency"
CACHE_SIZES = PREFIX + "rc:sizes"
CACHE_BYTES = PREFIX + "rc:bytes"
CACHE_CLOCK = PREFIX + "rc:clock"

TRACE_STATE = PREFIX + "trace:state"
TRACE_COUNTS = PREFIX + "trace:counts"
TRACE_EVENTS = PREFIX + "trace:events"


SHARD_MEMBERS = PREFIX + "shard:members"
SHARD_ADDRESSES = PREFIX + "shard:addresses"
SHARD_OWNERS = PREFIX + "shard:owners"
SHARD_TERMS = PREFIX + "shard:terms"
SHARD_VERSION = PREFIX + "shard:version"
SHARD_EVENTS = PREFIX + "shard:events"
TENSOR_SHM_HOSTS = PREFIX + "tshm:hosts"


def model(name: str) -> str:
    return f"{PREFIX}model:{name}"


def model_errors(name: str) -> str:
    return f"{PREFIX}model:{name}:errors"


def sequence_prefix(model: str, version: int) -> str:
    """Sequences of one model version (see services/scheduler/sequence_store.py)."""
    return f"{PREFIX}seq:{model}:{version}:"


def sequence_owner(owner: str) -> str:
    """Liveness of one scheduler's sequence store; "" gives the prefix."""
    return f"{PREFIX}seq-owner:{owner}"


def model_stats(model: str, generation: int, version: int) -> str:
    """Every gateway's ModelStatistics of one model load and version."""
    return f"{PREFIX}stats:{model}:g{generation}:v{version}"


def rl_freed_channel(prefix: str, origin: str) -> str:
    """Where Redis tells one rate limiter process that another freed something."""
    return f"{prefix}freed:{origin}"
