-- fail_unreadable: a record nobody can parse leaves the live set once, FAILED with its reason
-- (or, if its state is already terminal, just leaves).
--
-- KEYS: job, events, active, done, changes
-- ARGV: id, reason, now
-- Needs: lifecycle, _events
--
-- job     hash    the job record (sl:job:<id>)
-- events  stream  the job's event stream (sl:job:<id>:events)
-- active  set     ids of jobs not yet terminal (sl:jobs:active)
-- done    stream  (id, final state) of every job that ended (sl:done)
-- changes stream  the change stream the tick folds (sl:changes)
-- id      string  the job's id
-- reason  string  why the record is unreadable
-- now     string  the scheduler's clock, seconds since the epoch
--
-- Returns 1 when the job was failed, 0 when it had already ended.

local job = KEYS[1]
local events = KEYS[2]
local active = KEYS[3]
local done = KEYS[4]
local changes = KEYS[5]
local id = ARGV[1]
local reason = ARGV[2]
local now = ARGV[3]

local cur = redis.call('HGET', job, 'state') or ''
if TERMINAL[cur] then
  redis.call('SREM', active, id)
  changed(changes, job)
  return 0
end
redis.call('HSET', job, 'state', STATE.FAILED, 'error', reason, 'updated_at', now)
ended(job, active, done, id, STATE.FAILED, now)
changed(changes, job)
event(events, 'state', cur, STATE.FAILED, 'scheduler', reason, now)
return 1
