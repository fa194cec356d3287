-- _events: the lifecycle's writes shared by the store's scripts (a prelude, not a script).
--
-- event(stream, kind, from_state, to_state, by, reason, now)
--   appends one entry to a job's event stream (kept whole while the job lives: no MAXLEN).
-- ended(job, active, done, id, state, now)
--   a job reached a terminal state: it leaves the live set, gets its finish time, is announced
--   on the done stream, and its event stream expires after the record's ``events_ttl``
--   (the stream key is the job key plus ``:events``).
-- changed(changes, job, ...)
--   marks that the job record ``job`` (its key) was written, on the change stream the tick
--   reads to fold only what changed into its snapshot; extra field/value pairs ride along
--   (a commit's seq, chunk and service time). Every writer of a live record calls it, after
--   (or with) its write, once per script. It bumps the record's revision (field ``rev``) and
--   the mark carries the new one (``r``): a tick whose kept copy of the record is at least
--   that revision already holds the write (its own, folded from what it wrote) and reads
--   nothing. Returns the revision. The stream keeps about CHANGES_MAXLEN entries: a tick that
--   finds the entry it read last trimmed away reads every record again.
-- A 'state' event also keeps the live counters (what /metrics, /v1/stats and the tenants' queue
-- quotas read in O(1) instead of scanning every record): LIVE_BY_STATE counts the unfinished
-- jobs per 'STATE|slo', LIVE_BY_TENANT per tenant; a field at zero is dropped. count_live.lua
-- rebuilds both from the records. RAN scores each job that held a worker by when it last left
-- RUNNING (+inf while it runs; kept an hour): the dashboard's timeline reads the jobs that ran
-- in its window from it, not from every unfinished record. (tasks.keys names the same keys.)

local CHANGES_MAXLEN = 100000
local LIVE_BY_STATE = 'sl:jobs:live:state'
local LIVE_BY_TENANT = 'sl:jobs:live:tenant'
local RAN = 'sl:jobs:ran'
local RAN_KEEP_S = 3600

local function live_add(counter, field, delta)
  if redis.call('HINCRBY', counter, field, delta) <= 0 then redis.call('HDEL', counter, field) end
end

local function live_counts(stream, from_state, to_state, now)
  local was = from_state ~= '' and not TERMINAL[from_state]
  local is = not TERMINAL[to_state]
  local h = redis.call('HMGET', string.sub(stream, 1, -8), 'slo', 'tenant', 'id')
  if was then live_add(LIVE_BY_STATE, from_state .. '|' .. (h[1] or ''), -1) end
  if is then live_add(LIVE_BY_STATE, to_state .. '|' .. (h[1] or ''), 1) end
  if was ~= is then live_add(LIVE_BY_TENANT, h[2] or '', is and 1 or -1) end
  if to_state == STATE.RUNNING then
    redis.call('ZADD', RAN, 'inf', h[3] or '')
  elseif from_state == STATE.RUNNING then
    redis.call('ZADD', RAN, now, h[3] or '')
    redis.call('ZREMRANGEBYSCORE', RAN, '-inf', '(' .. (tonumber(now) - RAN_KEEP_S))
  end
end

local function event(stream, kind, from_state, to_state, by, reason, now)
  redis.call('XADD', stream, '*', 'kind', kind, 'from', from_state, 'to', to_state, 'by', by,
             'reason', reason, 'ts', now)
  if kind == 'state' and from_state ~= to_state then
    live_counts(stream, from_state, to_state, now)
  end
end

local function changed(changes, job, ...)
  local rev = redis.call('HINCRBY', job, 'rev', 1)
  redis.call('XADD', changes, 'MAXLEN', '~', CHANGES_MAXLEN, '*', 'k', job, 'r', rev, ...)
  return rev
end

local function ended(job, active, done, id, state, now)
  redis.call('SREM', active, id)
  redis.call('HSET', job, 'finished_at', now)
  redis.call('XADD', done, 'MAXLEN', '~', 100000, '*', 'id', id, 'state', state)
  local ttl = tonumber(redis.call('HGET', job, 'events_ttl') or '')
  if ttl ~= nil and ttl > 0 then
    redis.call('PEXPIRE', job .. ':events', math.floor(ttl * 1000))
  end
end
