"""Lua scripts of the sequence batcher's Redis side: list, claim, commit.

One claim runs as one Redis transaction, so two schedulers sharing a sequence
never both run its head entry, and a dead scheduler's entries are dropped in
the same step that checks the head.

Listing and commit are scripts too, not pipelines of plain commands: a
script is one command for the client to pack and one reply to parse, where
a pipeline costs redis-py's Python per command. Measured on the 2-core
development VM (redis-py 8.1 with hiredis, 3,000 calls): a commit of 8
sequences as a MULTI/EXEC pipeline of 24 commands took 691 us of the
scheduler's CPU, one script call with the same effect ~200 (docs/benchmarks.md,
"Sequence batches: one Redis command per step").
"""

from __future__ import annotations

# Keys (prefix = "ss:seq:{model}:{version}:"; see services/scheduler/sequence_store.py):
#   {prefix}{cid}        hash  slot, st:{state} -> raw bytes, sh:{state} -> "d0,d1"; PX idle
#   {prefix}{cid}:q      list  backlog entries "{owner}:{n}", arrival order; PX idle
#   {prefix}pins         hash  instance group -> the instance its sequences run on
#                              (instance_pins.py), as the owner last saved it; PX idle
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

# ARGV: prefix, owner key, owner ttl ms, idle ms, then (cid, entry, place
# "1"/"0") per request, in arrival order. Renews this scheduler's owner key
# and appends each entry to its sequence's backlog. 0 when no request asks
# for its place; else {the pins hash's fields and values, the slot (-1:
# none) of each sequence whose request has place "1", in order}: a
# sequence the scheduler has no slot for continues in the slot it had.
SEQUENCE_LIST = """
local p, owner_key, ttl, idle = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
redis.call('SET', owner_key, '1', 'PX', ttl)
local slots = {}
for i = 5, #ARGV, 3 do
  local key = p .. ARGV[i]
  redis.call('RPUSH', key .. ':q', ARGV[i + 1])
  redis.call('PEXPIRE', key .. ':q', idle)
  if ARGV[i + 2] == '1' then
    slots[#slots + 1] = tonumber(redis.call('HGET', key, 'slot')) or -1
  end
end
if #slots == 0 then return 0 end
return {redis.call('HGETALL', p .. 'pins'), slots}
"""

# ARGV: prefix, idle ms, terms hash key, model, term ("": none to check),
# np: -1 when the owner's instance pins did not change since its last
# commit, else the number of (group, instance) pairs that follow its writer
# id and serial (the pins as they are now: the next owner reads them; a
# writer's older serial arriving late, a reordered retry, is not written),
# then per request: cid, entry ("": never listed), flags, slot, n, and n
# (state name, raw bytes, shape "d0,d1") triples. Flags: "e" the request had
# END, "s" START, "h" it ran with states this scheduler kept
# (sequence_cache.py) instead of claiming them here.
#
# With a term, nothing is written when the model has another term (another
# scheduler may own the model's sequences since): returns {1}. No term at
# all means Redis restarted empty and nobody took the model since: the
# commit goes on, and a held row finds its sequence lost.
# Otherwise keeps each sequence's new states (n = 0: unchanged), ends the
# ones whose request had END, takes each listed entry off its backlog so the
# sequence's next request may run, and returns {0, i...}: the requests (1-based)
# whose kept states found no sequence in Redis (it was lost), which keep
# nothing. A rerun (a retried call whose first reply was lost) changes
# nothing more: the states are the same values and the entries are gone.
SEQUENCE_COMMIT = """
local p, idle, terms, model, term = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
if term ~= '' then
  local current = redis.call('HGET', terms, model)
  if current and current ~= term then
    return {1}
  end
end
local np, i = tonumber(ARGV[6]), 7
if np >= 0 then  -- saved before the batch's answers go out
  local pins, writer, serial = p .. 'pins', ARGV[7], tonumber(ARGV[8])
  i = 9 + 2 * np
  local last = redis.call('HMGET', pins, 'w', 'n')
  if last[1] ~= writer or (tonumber(last[2]) or -1) < serial then
    redis.call('DEL', pins)
    redis.call('HSET', pins, 'w', writer, 'n', serial)
    for j = 9, i - 1, 2 do
      redis.call('HSET', pins, ARGV[j], ARGV[j + 1])
    end
  end
end
redis.call('PEXPIRE', p .. 'pins', idle)  -- kept while the model's sequences run
local out = {0}
local row = 0
while i <= #ARGV do
  local key, entry, flags, slot, n =
    p .. ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], tonumber(ARGV[i + 4])
  local first = i + 5
  i = first + 3 * n
  row = row + 1
  local held, start = string.find(flags, 'h', 1, true), string.find(flags, 's', 1, true)
  if held and not start and redis.call('EXISTS', key) == 0 then
    out[#out + 1] = row
  elseif string.find(flags, 'e', 1, true) then
    redis.call('DEL', key)
  else
    if held and start then
      redis.call('DEL', key)
      redis.call('HSET', key, 'slot', slot)
    end
    for j = first, first + 3 * (n - 1), 3 do
      redis.call('HSET', key, 'st:' .. ARGV[j], ARGV[j + 1], 'sh:' .. ARGV[j], ARGV[j + 2])
    end
    if held or n > 0 then
      redis.call('PEXPIRE', key, idle)
    end
  end
  if entry ~= '' then
    redis.call('LREM', key .. ':q', 1, entry)
  end
end
return out
"""
