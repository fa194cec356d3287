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
--   (or with) its write. The stream keeps about CHANGES_MAXLEN entries: a tick that finds
--   the entry it read last trimmed away reads every record again.

local CHANGES_MAXLEN = 100000

local function event(stream, kind, from_state, to_state, by, reason, now)
  redis.call('XADD', stream, '*', 'kind', kind, 'from', from_state, 'to', to_state, 'by', by,
             'reason', reason, 'ts', now)
end

local function changed(changes, job, ...)
  redis.call('XADD', changes, 'MAXLEN', '~', CHANGES_MAXLEN, '*', 'k', job, ...)
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
