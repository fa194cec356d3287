-- count_live: count a tenant's unfinished jobs (its queue quota), dropping those that ended.
--
-- KEYS: live
-- ARGV: job_prefix
-- Needs: lifecycle
--
-- live        set     ids of the tenant's jobs submitted through the API (sl:tenant:<name>:live)
-- job_prefix  string  the job record key without the id (sl:job:)
--
-- Returns the number of jobs in ``live`` whose record exists and is not terminal.

local live = KEYS[1]
local job_prefix = ARGV[1]

local n = 0
for _, id in ipairs(redis.call('SMEMBERS', live)) do
  local state = redis.call('HGET', job_prefix .. id, 'state')
  if not state or TERMINAL[state] then
    redis.call('SREM', live, id)
  else
    n = n + 1
  end
end
return n
