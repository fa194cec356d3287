-- first_estimate: record the scheduler's first estimate of a job's service time, once, and
-- only on a record that exists (never recreating a deleted job's hash).
--
-- KEYS: job, changes
-- ARGV: field, value
-- Needs: _events
--
-- job      hash    the job record (sl:job:<id>)
-- changes  stream  the change stream the tick folds (sl:changes)
-- field    string  the record field of the first estimate
-- value    string  the estimate, seconds
--
-- Returns the record's revision after the write (>= 1), or 0 when nothing was written (an
-- estimate was kept already, or the record is gone).

local job = KEYS[1]
local changes = KEYS[2]
local field = ARGV[1]
local value = ARGV[2]

if redis.call('EXISTS', job) == 1 and redis.call('HSETNX', job, field, value) == 1 then
  return changed(changes, job)
end
return 0
