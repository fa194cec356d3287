-- batch_join: put a released job into an in-flight batch. A job joins only while the batch is
-- in flight: once its last step took the joiners and closed it, the caller publishes the job
-- on its own.
--
-- KEYS: open, joins
-- ARGV: member
--
-- open    string  set while the batch is in flight (sl:batch:<id>:open)
-- joins   list    jobs released into the batch, taken at its next step (sl:batch:<id>:joins)
-- member  JSON    [job id, chunk, epoch]
--
-- Returns 1 when the job joined, 0 when the batch has ended.

local open = KEYS[1]
local joins = KEYS[2]
local member = ARGV[1]

if redis.call('EXISTS', open) == 0 then return 0 end
redis.call('RPUSH', joins, member)
return 1
