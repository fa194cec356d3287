-- first_estimate: record the scheduler's first estimate of a job's service time, once, and
-- only on a record that exists (never recreating a deleted job's hash).
--
-- KEYS: job
-- ARGV: field, value
--
-- job    hash    the job record (sl:job:<id>)
-- field  string  the record field of the first estimate
-- value  string  the estimate, seconds
--
-- Returns 1.

local job = KEYS[1]
local field = ARGV[1]
local value = ARGV[2]

if redis.call('EXISTS', job) == 1 then redis.call('HSETNX', job, field, value) end
return 1
