"""Lua scripts of the scheduler's shard leases (stageserve/redis_keys.py,
"Schedulers sharded by model"). Each runs atomically, so two schedulers
never both hold a model: a take succeeds only while the model has no live
owner, a release only by its owner. Every change bumps ss:shard:version and
publishes it on ss:shard:events, which gateways and workers follow.

KEYS (all scripts): members, addresses, owners, version, terms.
ARGV[1]: the channel to publish on.

A model's term (terms hash) is a token the new owner's side makes up at
each change of owner, so a scheduler that holds the same term as Redis has
owned the model without a break since it read it. A hand-over to nobody
makes a new term too, so only a Redis restarted empty has none (and then
nobody has taken the model since). The sequence batcher's commit checks it
(sequence_lua.SEQUENCE_COMMIT) before keeping states it did not read from
Redis.
"""

from __future__ import annotations

_PRELUDE = """
local members, addresses, owners, version, terms = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local channel = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function bump()
  local v = redis.call('INCR', version)
  redis.call('PUBLISH', channel, v)
end
"""

# ARGV: channel, scheduler id, address, lease ms.
# Renew this scheduler's lease, forget schedulers whose lease ran out, and
# return the live scheduler ids.
RENEW = (
    _PRELUDE
    + """
local id, address, lease = ARGV[2], ARGV[3], tonumber(ARGV[4])
local changed = false
if redis.call('ZADD', members, now + lease, id) == 1 then changed = true end
if redis.call('HGET', addresses, id) ~= address then
  redis.call('HSET', addresses, id, address)
  changed = true
end
local dead = redis.call('ZRANGEBYSCORE', members, '-inf', '(' .. now)
for _, d in ipairs(dead) do
  redis.call('ZREM', members, d)
  redis.call('HDEL', addresses, d)
  changed = true
end
if changed then bump() end
return redis.call('ZRANGEBYSCORE', members, now, '+inf')
"""
)

# ARGV: channel, scheduler id, model, "1" if it may take a model no live
# scheduler owns ("0": only adopt one handed to it), a new term token. The
# model's term when it is this scheduler's (taken now, with the new token,
# or already), 0 when it is not.
TAKE = (
    _PRELUDE
    + """
local id, model, may_take, token = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local current = redis.call('HGET', owners, model)
if current == id then
  local term = redis.call('HGET', terms, model)
  if term then return term end
  redis.call('HSET', terms, model, token)
  return token
end
if may_take ~= '1' then return 0 end
if current then
  local deadline = redis.call('ZSCORE', members, current)
  if deadline and tonumber(deadline) >= now then return 0 end
end
redis.call('HSET', owners, model, id)
redis.call('HSET', terms, model, token)
bump()
return token
"""
)

# ARGV: channel, scheduler id, model, next owner ("" : none), a new term
# token (the next owner's, or none's). Hand a model this scheduler owns to the next
# owner; 0 if it was not this scheduler's.
RELEASE = (
    _PRELUDE
    + """
local id, model, heir, token = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if redis.call('HGET', owners, model) ~= id then return 0 end
if heir ~= '' then
  redis.call('HSET', owners, model, heir)
  redis.call('HSET', terms, model, token)
else
  redis.call('HDEL', owners, model)
  redis.call('HSET', terms, model, token)
end
bump()
return 1
"""
)

# ARGV: channel, scheduler id. Leave: no lease, no address.
LEAVE = (
    _PRELUDE
    + """
local id = ARGV[2]
redis.call('ZREM', members, id)
redis.call('HDEL', addresses, id)
bump()
return 1
"""
)
