-- flag_preempt: flag a job's running attempt to stop at its next boundary, only for the
-- attempt the tick saw.
--
-- KEYS: job, changes
-- ARGV: state, epoch
-- Needs: _events
--
-- job      hash    the job record (sl:job:<id>)
-- changes  stream  the change stream the tick folds (sl:changes)
-- state    string  the state the caller saw
-- epoch    int     the epoch the caller saw
--
-- Returns the record's revision after the flag (>= 1: the flag's mark carries it), 0 when the
-- job moved on.

local job = KEYS[1]
local changes = KEYS[2]
local state = ARGV[1]
local epoch = ARGV[2]

local h = redis.call('HMGET', job, 'state', 'epoch')
if h[1] ~= state or h[2] ~= epoch then return 0 end
redis.call('HSET', job, 'preempt', '1')
return changed(changes, job)
