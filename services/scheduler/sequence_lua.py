"""Lua script that claims sequence requests in Redis atomically.

One claim runs as one Redis transaction, so two schedulers sharing a sequence
never both run its head entry, and a dead scheduler's entries are dropped in
the same step that checks the head.
"""

from __future__ import annotations

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
