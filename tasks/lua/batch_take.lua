-- batch_take: the joiners of a batch so far, taken in one step with the batch's open mark:
-- renewed while the batch goes on, dropped when it ends, so a join is either taken here or
-- refused (never left behind).
--
-- KEYS: open, joins
-- ARGV: keep, lease_ms
--
-- open      string  set while the batch is in flight (sl:batch:<id>:open)
-- joins     list    jobs released into the batch (sl:batch:<id>:joins)
-- keep      '1'|'0' '1': the batch goes on (its open mark renewed); '0': it ends
-- lease_ms  int     how long the renewed open mark lives
--
-- Returns the joiners' members (JSON [job id, chunk, epoch] each), oldest first.

local open = KEYS[1]
local joins = KEYS[2]
local keep = ARGV[1]
local lease_ms = ARGV[2]

local joiners = redis.call('LRANGE', joins, 0, -1)
redis.call('DEL', joins)
if keep == '1' then
  redis.call('SET', open, '1', 'PX', lease_ms)
else
  redis.call('DEL', open)
end
return joiners
