-- flag_preempt: flag a job's running attempt to stop at its next boundary, only for the
-- attempt the tick saw.
--
-- KEYS: job
-- ARGV: state, epoch
--
-- job    hash    the job record (sl:job:<id>)
-- state  string  the state the caller saw
-- epoch  int     the epoch the caller saw
--
-- Returns 1 when flagged, 0 when the job moved on.

local job = KEYS[1]
local state = ARGV[1]
local epoch = ARGV[2]

local h = redis.call('HMGET', job, 'state', 'epoch')
if h[1] ~= state or h[2] ~= epoch then return 0 end
redis.call('HSET', job, 'preempt', '1')
return 1
