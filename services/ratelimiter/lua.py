"""Lua scripts that keep the rate limiter's registry and grants atomic.

Each script runs as one Redis transaction, so two rate-limiter processes (or
a crash half-way) can never hand one instance to two payloads or lose one.
Keys are derived inside the scripts from the prefix in ARGV[1] (single-node
Redis; the layout is documented in redis_keys.py).
"""

from __future__ import annotations

_REMOVE_WORKER = """
-- A grant ends: its hash and lease go, and the resources it took (the need
-- recorded on the grant, so a config change meanwhile cannot skew the
-- counts) go back. Returns the instance id and whether resources were held.
local function end_grant(p, gid)
  local g = redis.call('HMGET', p .. 'grant:' .. gid, 'instance', 'need')
  redis.call('ZREM', p .. 'grants', gid)
  redis.call('DEL', p .. 'grant:' .. gid)
  local took = false
  if g[2] and g[2] ~= '' then
    for _, n in ipairs(cjson.decode(g[2])) do
      redis.call('HINCRBY', p .. 'res:held', n[1], -n[2])
      took = true
    end
  end
  return g[1], took
end

-- Each resource's available count: the largest count any registered instance
-- asks for (per device scope, or across all for a global one), unless an
-- override (--rate-limit-resource) names it: "name@device" before "name".
local function recompute_caps(p)
  local cap, names = {}, {}
  for _, wid in ipairs(redis.call('SMEMBERS', p .. 'workers')) do
    for _, iid in ipairs(redis.call('SMEMBERS', p .. 'worker:' .. wid .. ':insts')) do
      local need = redis.call('HGET', p .. 'inst:' .. iid, 'need')
      if need and need ~= '' then
        for _, n in ipairs(cjson.decode(need)) do
          if not cap[n[1]] or cap[n[1]] < n[2] then cap[n[1]] = n[2] end
          names[n[1]] = {n[3], n[4]}
        end
      end
    end
  end
  redis.call('DEL', p .. 'res:cap')
  for key, count in pairs(cap) do
    local name, dev = names[key][1], names[key][2]
    local ov = nil
    if dev ~= '' then ov = redis.call('HGET', p .. 'res:override', name .. '@' .. dev) end
    ov = ov or redis.call('HGET', p .. 'res:override', name)
    redis.call('HSET', p .. 'res:cap', key, tonumber(ov) or count)
  end
  -- a resource no instance needs any more, and nobody holds, is forgotten
  local held = redis.call('HGETALL', p .. 'res:held')
  for i = 1, #held, 2 do
    if not cap[held[i]] and tonumber(held[i + 1]) == 0 then
      redis.call('HDEL', p .. 'res:held', held[i])
    end
  end
end

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
    if not iid or gone[iid] then end_grant(p, gid) end
  end
  recompute_caps(p)
end

local function remove_worker(p, wid)
  local insts = redis.call('SMEMBERS', p .. 'worker:' .. wid .. ':insts')
  drop_instances(p, wid, insts)
  redis.call('DEL', p .. 'worker:' .. wid .. ':insts', p .. 'worker:' .. wid)
  redis.call('SREM', p .. 'workers', wid)
  return #insts
end
"""

# ARGV: prefix, worker_id, address, lease_ms, then 7-tuples per instance:
#   iid, model, version, kind, device_id, priority, resources (JSON list of
#   [name, global 0/1, count])
# A worker that registers without a live liveness key (new, or back after its
# lease lapsed) starts afresh: whatever is left of an earlier registration is
# stale (an acquire may already have dropped its instances from the free list).
# A resource's scope is "global", or the instance's device: "{worker}/{device}"
# (each worker owns its devices, so a joining worker adds capacity).
REGISTER = (
    _REMOVE_WORKER
    + """
local p, wid, addr, lease = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
if redis.call('EXISTS', p .. 'worker:' .. wid) == 0 then remove_worker(p, wid) end
redis.call('SET', p .. 'worker:' .. wid, addr, 'PX', lease)
redis.call('SADD', p .. 'workers', wid)
local wanted = {}
for i = 5, #ARGV, 7 do wanted[ARGV[i]] = i end
local stale = {}
for _, iid in ipairs(redis.call('SMEMBERS', p .. 'worker:' .. wid .. ':insts')) do
  if not wanted[iid] then table.insert(stale, iid) end
end
drop_instances(p, wid, stale)
-- A new instance starts at the lowest scaled count (executions x priority)
-- among the instances already registered, not at 0: otherwise a reloaded
-- model or a joining worker would take every contended pick until its count
-- caught up with instances that ran for hours (beyond Triton).
local floor_scaled = nil
for _, w in ipairs(redis.call('SMEMBERS', p .. 'workers')) do
  for _, other in ipairs(redis.call('SMEMBERS', p .. 'worker:' .. w .. ':insts')) do
    local f = redis.call('HMGET', p .. 'inst:' .. other, 'execs', 'prio', 'need')
    if f[3] and f[3] ~= '' then
      local scaled = (tonumber(f[1]) or 0) * math.max(tonumber(f[2]) or 0, 1)
      if not floor_scaled or scaled < floor_scaled then floor_scaled = scaled end
    end
  end
end
local added = 0
for iid, i in pairs(wanted) do
  if redis.call('EXISTS', p .. 'inst:' .. iid) == 0 then
    local pk = ARGV[i + 1] .. ':' .. ARGV[i + 2]
    local need = {}
    for _, r in ipairs(cjson.decode(ARGV[i + 6] ~= '' and ARGV[i + 6] or '[]')) do
      local name, global, count = r[1], r[2], tonumber(r[3])
      if count > 0 then
        if global == 1 then
          table.insert(need, {name .. '@global', count, name, ''})
        else
          local dev = ARGV[i + 4]
          table.insert(need, {name .. '@' .. wid .. '/' .. dev, count, name, dev})
        end
      end
    end
    redis.call('HSET', p .. 'inst:' .. iid, 'model', ARGV[i + 1], 'version', ARGV[i + 2],
      'kind', ARGV[i + 3], 'device_id', ARGV[i + 4], 'worker_id', wid, 'worker_address', addr,
      'prio', ARGV[i + 5], 'need', #need > 0 and cjson.encode(need) or '',
      'execs', math.floor((floor_scaled or 0) / math.max(tonumber(ARGV[i + 5]) or 0, 1)))
    redis.call('SADD', p .. 'worker:' .. wid .. ':insts', iid)
    redis.call('SADD', p .. 'pool:' .. pk, iid)
    redis.call('RPUSH', p .. 'free:' .. pk, iid)
    added = added + 1
  end
end
recompute_caps(p)
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

# ARGV: prefix, then (name or name@device, count) pairs: the --rate-limit-resource
# overrides; replaces the previous set and recomputes every available count.
SET_OVERRIDES = (
    _REMOVE_WORKER
    + """
local p = ARGV[1]
redis.call('DEL', p .. 'res:override')
for i = 2, #ARGV, 2 do redis.call('HSET', p .. 'res:override', ARGV[i], ARGV[i + 1]) end
recompute_caps(p)
return 1
"""
)

# ARGV: prefix, model, version, grant_id, now_ms, lease_ms, mode, demand_ttl_ms,
# origin, waiting_ttl_ms[, n, only ids (n), other_than ids]
# -> nil if nothing can run now, -3 if this pool waits for another pool's
#    lower scaled priority, -1 if no instance is registered, {-2, reason}
#    if no instance can ever run (a resource need above its available count),
#    else {iid, kind, device_id, worker_id, worker_address, holds resources
#    0/1, priority}
#
# A busy answer (nil) adds `origin` (the asking rate limiter) to the waiting
# sets of the pool and of any pool, so a release by another rate limiter
# process tells it (see _NOTIFY). A -3 is not signalled by any release (the
# other pool's demand just lapses): the asker looks again soon on its own.
#
# mode "off": one payload per free instance, resources ignored (the fast path;
# grants may be reused by the scheduler).
# mode "execution_count" (Triton's rate limiter): an instance runs a payload
# only while it holds all its resources. Among the model's free instances
# whose resources are free, the one with the lowest scaled priority
# (executions x max(priority, 1), Triton's rule) is picked. Other pools that
# asked recently (the demand set, refreshed by every Acquire) are weighed
# too: if one of them could run now, would be stopped by this grant, and has
# a lower scaled priority, this one waits. A pool whose resources are busy
# never makes another wait (no head-of-line blocking across models).
#
# ARGV[11] (optional) = n, then n instance ids (`only`: the grant names one of
# them; a sequence model's pinned instances), then more ids (`other_than`:
# the grant names none of them while the pool has another instance). When
# none of `only` is registered with a live worker: {-4, those ids}.
ACQUIRE = """
local p, model, ver, gid = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local now, lease, mode, ttl = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7], tonumber(ARGV[8])
local origin, wttl = ARGV[9], tonumber(ARGV[10])
local pk = model .. ':' .. ver
local free = p .. 'free:' .. pk
local pool = p .. 'pool:' .. pk

-- registered, with a live worker
local function live(iid)
  local wid = redis.call('HGET', p .. 'inst:' .. iid, 'worker_id')
  return redis.call('SISMEMBER', pool, iid) == 1 and wid
    and redis.call('EXISTS', p .. 'worker:' .. wid) == 1
end

local n_only = tonumber(ARGV[11] or '0') or 0
local only, other, has_other = {}, {}, false
for i = 12, 11 + n_only do only[ARGV[i]] = true end
for i = 12 + n_only, #ARGV do other[ARGV[i]] = true; has_other = true end
if has_other then  -- a preference: kept only while another instance is there
  has_other = false
  for _, iid in ipairs(redis.call('SMEMBERS', pool)) do
    if not other[iid] and live(iid) then has_other = true; break end
  end
end
local filtered = n_only > 0 or has_other
local function allowed(iid)
  if n_only > 0 then return only[iid] == true end
  return not (has_other and other[iid])
end
-- {-4, ids} when no instance of `only` is there any more, else nil
local function gone()
  if n_only == 0 then return nil end
  local out = {-4}
  for iid in pairs(only) do
    if live(iid) then return nil end
    table.insert(out, iid)
  end
  return out
end

local function busy()
  if origin and origin ~= '' then
    for _, key in ipairs({p .. 'waiting:' .. pk, p .. 'waiting'}) do
      redis.call('ZADD', key, now + wttl, origin)
      redis.call('PEXPIRE', key, wttl)
    end
  end
  return nil
end

local function grant(iid, f, need)
  redis.call('HSET', p .. 'grant:' .. gid, 'instance', iid, 'model', model, 'version', ver,
    'need', need or '')
  redis.call('ZADD', p .. 'grants', now + lease, gid)
  return {iid, f[1], f[2], f[3], f[4], need and need ~= '' and '1' or '0', f[5] or '0'}
end

if mode ~= 'execution_count' and not filtered then
  while true do
    local iid = redis.call('LPOP', free)
    if not iid then
      if redis.call('SCARD', pool) == 0 then return -1 end
      return busy()
    end
    local f = redis.call('HMGET', p .. 'inst:' .. iid, 'kind', 'device_id', 'worker_id',
      'worker_address', 'prio')
    if f[3] and redis.call('EXISTS', p .. 'worker:' .. f[3]) == 1 then
      return grant(iid, f, nil)
    end
    -- a stale entry (its worker is gone): drop it and look further
  end
end
if mode ~= 'execution_count' then
  for _, iid in ipairs(redis.call('LRANGE', free, 0, -1)) do
    local f = redis.call('HMGET', p .. 'inst:' .. iid, 'kind', 'device_id', 'worker_id',
      'worker_address', 'prio')
    if not (f[3] and redis.call('EXISTS', p .. 'worker:' .. f[3]) == 1) then
      redis.call('LREM', free, 0, iid)  -- stale
    elseif allowed(iid) then
      redis.call('LREM', free, 1, iid)
      return grant(iid, f, nil)
    end
  end
  if redis.call('SCARD', pool) == 0 then return -1 end
  return gone() or busy()
end

local held = {}
local function held_of(key)
  if held[key] == nil then held[key] = tonumber(redis.call('HGET', p .. 'res:held', key)) or 0 end
  return held[key]
end
local caps = {}
local function cap_of(key)
  if caps[key] == nil then caps[key] = tonumber(redis.call('HGET', p .. 'res:cap', key)) or 0 end
  return caps[key]
end
local function runnable(need, taken)
  for _, n in ipairs(need) do
    if held_of(n[1]) + (taken[n[1]] or 0) + n[2] > cap_of(n[1]) then return false end
  end
  return true
end
local function decode(s) if s and s ~= '' then return cjson.decode(s) end return {} end

-- The best instance of a pool that can run now (given resources `taken`
-- beyond those held): {iid, scaled priority, need table, need text}.
local function best(pool_key, taken, drop_stale, pick)
  local out = nil
  for _, iid in ipairs(redis.call('LRANGE', p .. 'free:' .. pool_key, 0, -1)) do
    local f = redis.call('HMGET', p .. 'inst:' .. iid, 'worker_id', 'need', 'prio', 'execs')
    if f[1] and redis.call('EXISTS', p .. 'worker:' .. f[1]) == 1 then
      local need = decode(f[2])
      if (not pick or pick(iid)) and runnable(need, taken) then
        local prio = math.max(tonumber(f[3]) or 0, 1)
        local scaled = (tonumber(f[4]) or 0) * prio
        if not out or scaled < out[2] then out = {iid, scaled, need, f[2]} end
      end
    elseif drop_stale then
      redis.call('LREM', p .. 'free:' .. pool_key, 0, iid)
    end
  end
  return out
end

redis.call('ZREMRANGEBYSCORE', p .. 'demand', '-inf', now)
redis.call('ZADD', p .. 'demand', now + ttl, pk)
local mine = best(pk, {}, true, filtered and allowed or nil)
if not mine then
  if redis.call('SCARD', pool) == 0 then return -1 end
  local g = gone()
  if g then return g end
  -- busy, or can never run: say which when no instance could ever run
  local reason = nil
  for _, iid in ipairs(redis.call('SMEMBERS', p .. 'pool:' .. pk)) do
    local over = nil
    for _, n in ipairs(decode(redis.call('HGET', p .. 'inst:' .. iid, 'need'))) do
      if n[2] > cap_of(n[1]) then
        over = 'resource ' .. n[3] .. ' needs ' .. n[2] .. ' but only ' .. cap_of(n[1])
          .. ' are available'
      end
    end
    if not over then return busy() end
    reason = reason or over
  end
  return {-2, reason}
end
if #mine[3] > 0 then
  local taken = {}
  for _, n in ipairs(mine[3]) do taken[n[1]] = n[2] end
  for _, other in ipairs(redis.call('ZRANGEBYSCORE', p .. 'demand', now, '+inf')) do
    if other ~= pk then
      local theirs = best(other, {}, false)
      if theirs and theirs[2] < mine[2] and not best(other, taken, false) then
        return -3  -- a pool with a lower scaled priority goes first
      end
    end
  end
  for _, n in ipairs(mine[3]) do redis.call('HINCRBY', p .. 'res:held', n[1], n[2]) end
end
redis.call('LREM', free, 1, mine[1])
redis.call('HINCRBY', p .. 'inst:' .. mine[1], 'execs', 1)
local f = redis.call('HMGET', p .. 'inst:' .. mine[1], 'kind', 'device_id', 'worker_id',
  'worker_address', 'prio')
return grant(mine[1], f, mine[4])
"""

# Tells the rate limiters waiting on a pool (or, "*", on any pool: freed
# resources or a removed worker change every pool's answer) that something
# was freed, on their channel {prefix}freed:{origin}. The one that freed it
# (`origin`) wakes its own waiters itself and is not told. A waiting set is
# a zset origin -> until when (ms) its last busy answer counts, so a rate
# limiter that stopped waiting (or exited: each start has a new origin) is
# dropped after WAITING_TTL_MS even while others keep the set alive.
_NOTIFY = """
local function notify(p, origin, key, what, now)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  for _, o in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    if o ~= origin then redis.call('PUBLISH', p .. 'freed:' .. o, what) end
  end
end
"""

# ARGV: prefix, origin, now_ms: tell every other waiting rate limiter that
# the registry changed (a worker registered or left through this one).
NOTIFY_ALL = (
    _NOTIFY + "notify(ARGV[1], ARGV[2], ARGV[1] .. 'waiting', '*', tonumber(ARGV[3]))\nreturn 1\n"
)

_RELEASE = (
    _NOTIFY
    + """
-- 0: not held; 1: released; 2: released and it held resources
local function release(p, gid, failed, origin, now)
  local g = redis.call('HMGET', p .. 'grant:' .. gid, 'model', 'version')
  local iid, took = end_grant(p, gid)
  if not iid then return 0 end
  local result = took and 2 or 1
  local wid = redis.call('HGET', p .. 'inst:' .. iid, 'worker_id')
  if not wid then return result end
  local pk = g[1] .. ':' .. g[2]
  if failed then
    remove_worker(p, wid)
    notify(p, origin, p .. 'waiting', '*', now)
  elseif redis.call('EXISTS', p .. 'worker:' .. wid) == 1 then
    redis.call('RPUSH', p .. 'free:' .. pk, iid)
    if took then
      notify(p, origin, p .. 'waiting', '*', now)
    else
      notify(p, origin, p .. 'waiting:' .. pk, pk, now)
    end
  elseif took then
    notify(p, origin, p .. 'waiting', '*', now)
  end
  return result
end
"""
)

# ARGV: prefix, grant_id, failed ("1"/"0"), origin, now_ms -> 0 not held,
# 1 released, 2 released and resources went back
RELEASE = (
    _REMOVE_WORKER
    + _RELEASE
    + "return release(ARGV[1], ARGV[2], ARGV[3] == '1', ARGV[4] or '', tonumber(ARGV[5]) or 0)\n"
)

# ARGV: prefix, now_ms, origin -> {expired grants released, dead workers removed}
SWEEP = (
    _REMOVE_WORKER
    + _RELEASE
    + """
local p, now, origin = ARGV[1], tonumber(ARGV[2]), ARGV[3] or ''
local expired = redis.call('ZRANGEBYSCORE', p .. 'grants', '-inf', now, 'LIMIT', 0, 256)
for _, gid in ipairs(expired) do release(p, gid, false, origin, now) end
local dead = 0
for _, wid in ipairs(redis.call('SMEMBERS', p .. 'workers')) do
  if redis.call('EXISTS', p .. 'worker:' .. wid) == 0 then
    remove_worker(p, wid)
    dead = dead + 1
  end
end
if dead > 0 then notify(p, origin, p .. 'waiting', '*', now) end
return {#expired, dead}
"""
)

# ARGV: prefix, origin, now_ms, a scheduler id's grant-id prefix ("<id>/"),
# this process's ("<id>/<incarnation>/") -> how many grants ended: every grant
# of an earlier process of that scheduler id, released as its holder would.
RELEASE_HOLDER = (
    _REMOVE_WORKER
    + _RELEASE
    + """
local p, origin, now, mine, keep = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local ended = 0
for _, gid in ipairs(redis.call('ZRANGE', p .. 'grants', 0, -1)) do
  if string.sub(gid, 1, #mine) == mine and string.sub(gid, 1, #keep) ~= keep then
    if release(p, gid, false, origin, now) > 0 then ended = ended + 1 end
  end
end
return ended
"""
)

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
