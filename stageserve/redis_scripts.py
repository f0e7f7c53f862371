"""Lua scripts that keep the rate limiter's registry and grants atomic.

Each script runs as one Redis transaction, so two rate-limiter processes (or
a crash half-way) can never hand one instance to two payloads or lose one.
Keys are derived inside the scripts from the prefix in ARGV[1] (single-node
Redis; the layout is documented in redis_keys.py).
"""

from __future__ import annotations

_REMOVE_WORKER = """
-- Unregister instances of worker wid. Grants on them end with them: a late
-- release must not free an instance that was registered again under the same
-- id in the meantime (a model reload, a worker back after its lease lapsed).
local function drop_instances(p, wid, iids)
  if #iids == 0 then return end
  local gone = {}
  for _, iid in ipairs(iids) do
    gone[iid] = true
    local m = redis.call('HMGET', p .. 'inst:' .. iid, 'model', 'version')
    if m[1] then
      local pk = m[1] .. ':' .. m[2]
      redis.call('SREM', p .. 'pool:' .. pk, iid)
      redis.call('LREM', p .. 'free:' .. pk, 0, iid)
    end
    redis.call('DEL', p .. 'inst:' .. iid)
    redis.call('SREM', p .. 'worker:' .. wid .. ':insts', iid)
  end
  for _, gid in ipairs(redis.call('ZRANGE', p .. 'grants', 0, -1)) do
    local iid = redis.call('HGET', p .. 'grant:' .. gid, 'instance')
    if not iid or gone[iid] then
      redis.call('DEL', p .. 'grant:' .. gid)
      redis.call('ZREM', p .. 'grants', gid)
    end
  end
end

local function remove_worker(p, wid)
  local insts = redis.call('SMEMBERS', p .. 'worker:' .. wid .. ':insts')
  drop_instances(p, wid, insts)
  redis.call('DEL', p .. 'worker:' .. wid .. ':insts', p .. 'worker:' .. wid)
  redis.call('SREM', p .. 'workers', wid)
  return #insts
end
"""

# ARGV: prefix, worker_id, address, lease_ms, then 6-tuples per instance:
#   iid, model, version, kind, device_id, (unused)
# A worker that registers without a live liveness key (new, or back after its
# lease lapsed) starts afresh: whatever is left of an earlier registration is
# stale (an acquire may already have dropped its instances from the free list).
REGISTER = (
    _REMOVE_WORKER
    + """
local p, wid, addr, lease = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
if redis.call('EXISTS', p .. 'worker:' .. wid) == 0 then remove_worker(p, wid) end
redis.call('SET', p .. 'worker:' .. wid, addr, 'PX', lease)
redis.call('SADD', p .. 'workers', wid)
local wanted = {}
for i = 5, #ARGV, 6 do wanted[ARGV[i]] = i end
local stale = {}
for _, iid in ipairs(redis.call('SMEMBERS', p .. 'worker:' .. wid .. ':insts')) do
  if not wanted[iid] then table.insert(stale, iid) end
end
drop_instances(p, wid, stale)
local added = 0
for iid, i in pairs(wanted) do
  if redis.call('EXISTS', p .. 'inst:' .. iid) == 0 then
    local pk = ARGV[i + 1] .. ':' .. ARGV[i + 2]
    redis.call('HSET', p .. 'inst:' .. iid, 'model', ARGV[i + 1], 'version', ARGV[i + 2],
      'kind', ARGV[i + 3], 'device_id', ARGV[i + 4], 'worker_id', wid, 'worker_address', addr)
    redis.call('SADD', p .. 'worker:' .. wid .. ':insts', iid)
    redis.call('SADD', p .. 'pool:' .. pk, iid)
    redis.call('RPUSH', p .. 'free:' .. pk, iid)
    added = added + 1
  end
end
return added
"""
)

# ARGV: prefix, worker_id, lease_ms -> 1 if the worker is still registered
HEARTBEAT = """
local p, wid, lease = ARGV[1], ARGV[2], tonumber(ARGV[3])
if redis.call('SISMEMBER', p .. 'workers', wid) == 0 then return 0 end
if redis.call('PEXPIRE', p .. 'worker:' .. wid, lease) == 0 then return 0 end
return 1
"""

# ARGV: prefix, worker_id
DEREGISTER = _REMOVE_WORKER + "return remove_worker(ARGV[1], ARGV[2])\n"

# ARGV: prefix, model, version, grant_id, now_ms, lease_ms
# -> nil if nothing free, -1 if no instance is registered, else
#    {iid, kind, device_id, worker_id, worker_address}
ACQUIRE = """
local p, pk, gid = ARGV[1], ARGV[2] .. ':' .. ARGV[3], ARGV[4]
local deadline = tonumber(ARGV[5]) + tonumber(ARGV[6])
while true do
  local iid = redis.call('LPOP', p .. 'free:' .. pk)
  if not iid then
    if redis.call('SCARD', p .. 'pool:' .. pk) == 0 then return -1 end
    return nil
  end
  local f = redis.call('HMGET', p .. 'inst:' .. iid, 'kind', 'device_id', 'worker_id',
    'worker_address')
  if f[3] and redis.call('EXISTS', p .. 'worker:' .. f[3]) == 1 then
    redis.call('HSET', p .. 'grant:' .. gid, 'instance', iid, 'model', ARGV[2],
      'version', ARGV[3])
    redis.call('ZADD', p .. 'grants', deadline, gid)
    return {iid, f[1], f[2], f[3], f[4]}
  end
  -- a stale entry (its worker is gone): drop it and look further
end
"""

_RELEASE = """
local function release(p, gid, failed)
  local g = redis.call('HMGET', p .. 'grant:' .. gid, 'instance', 'model', 'version')
  redis.call('ZREM', p .. 'grants', gid)
  if not g[1] then return 0 end
  redis.call('DEL', p .. 'grant:' .. gid)
  local wid = redis.call('HGET', p .. 'inst:' .. g[1], 'worker_id')
  if not wid then return 1 end
  if failed then
    remove_worker(p, wid)
  elseif redis.call('EXISTS', p .. 'worker:' .. wid) == 1 then
    redis.call('RPUSH', p .. 'free:' .. g[2] .. ':' .. g[3], g[1])
  end
  return 1
end
"""

# ARGV: prefix, grant_id, failed ("1"/"0") -> 1 if the grant was held
RELEASE = _REMOVE_WORKER + _RELEASE + "return release(ARGV[1], ARGV[2], ARGV[3] == '1')\n"

# ARGV: prefix, now_ms -> {expired grants released, dead workers removed}
SWEEP = (
    _REMOVE_WORKER
    + _RELEASE
    + """
local p, now = ARGV[1], tonumber(ARGV[2])
local expired = redis.call('ZRANGEBYSCORE', p .. 'grants', '-inf', now, 'LIMIT', 0, 256)
for _, gid in ipairs(expired) do release(p, gid, false) end
local dead = 0
for _, wid in ipairs(redis.call('SMEMBERS', p .. 'workers')) do
  if redis.call('EXISTS', p .. 'worker:' .. wid) == 0 then
    remove_worker(p, wid)
    dead = dead + 1
  end
end
return {#expired, dead}
"""
)

# ---------------------------------------------------------------- sequences
# Keys (prefix = "ss:seq:{model}:{version}:"; see services/scheduler/sequence_store.py):
#   {prefix}{cid}        hash  slot, st:{state} -> raw bytes, sh:{state} -> "d0,d1"; PX idle
#   {prefix}{cid}:q      list  backlog entries "{owner}:{n}", arrival order; PX idle
#   ss:seq-owner:{owner} str   a scheduler's liveness; PX OWNER_TTL_MS

# ARGV: prefix, owner key prefix, owner, owner ttl ms, idle ms, then
# (cid, entry, start "1"/"0", slot) per request -> per request
# {status, slot, {field, value, ...}}: status 0 claimed (the entry heads the
# backlog), 1 unknown sequence (no START seen or it idled out; the entry is
# dropped), 2 wait (an earlier request of the sequence has not finished).
SEQUENCE_CLAIM = """
local p, op, owner, ttl, idle = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
redis.call('SET', op .. owner, '1', 'PX', ttl)  -- our own entries are never stale here
local out = {}
for i = 6, #ARGV, 4 do
  local key, entry, start, slot = p .. ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local q = key .. ':q'
  local head = redis.call('LINDEX', q, 0)
  -- entries of dead schedulers (owner key expired) never finish: drop them
  while head and head ~= entry
      and redis.call('EXISTS', op .. string.match(head, '^[^:]*')) == 0 do
    redis.call('LPOP', q)
    head = redis.call('LINDEX', q, 0)
  end
  if head ~= entry then
    -- an earlier request of the sequence is unfinished; an entry that was
    -- lost (the backlog idled out) joins the back again
    if not redis.call('LPOS', q, entry) then
      redis.call('RPUSH', q, entry)
    end
    redis.call('PEXPIRE', q, idle)
    out[#out + 1] = {2, -1, {}}
  elseif start == '1' then
    redis.call('DEL', key)
    redis.call('HSET', key, 'slot', slot)
    redis.call('PEXPIRE', key, idle)
    redis.call('PEXPIRE', q, idle)
    out[#out + 1] = {0, tonumber(slot), {}}
  elseif redis.call('EXISTS', key) == 0 then
    redis.call('LPOP', q)
    out[#out + 1] = {1, -1, {}}
  else
    redis.call('PEXPIRE', key, idle)
    redis.call('PEXPIRE', q, idle)
    local s = redis.call('HGET', key, 'slot')
    out[#out + 1] = {0, tonumber(s) or -1, redis.call('HGETALL', key)}
  end
end
return out
"""

# ARGV: prefix, now_ms, lease_ms, grant ids... -> the ids no longer held
RENEW = """
local p, deadline = ARGV[1], tonumber(ARGV[2]) + tonumber(ARGV[3])
local lost = {}
for i = 4, #ARGV do
  if redis.call('ZSCORE', p .. 'grants', ARGV[i]) then
    redis.call('ZADD', p .. 'grants', 'XX', deadline, ARGV[i])
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""
