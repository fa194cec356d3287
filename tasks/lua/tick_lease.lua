-- tick_lease: take or renew the tick lease; another live scheduler keeps it until it stops
-- ticking (one tick runs at a time cluster-wide).
--
-- KEYS: lease
-- ARGV: holder, ttl_ms
--
-- lease   string  the scheduler worker holding the tick (sl:tick:lease)
-- holder  string  the worker asking for it
-- ttl_ms  int     how long the lease lives without a renewal
--
-- Returns 2 when ``holder`` held the lease and renewed it, 1 when it took it (free or lapsed:
-- another scheduler may have ticked meanwhile), 0 when another holds it.

local lease = KEYS[1]
local holder = ARGV[1]
local ttl_ms = ARGV[2]

local current = redis.call('GET', lease)
if current == false or current == holder then
  redis.call('SET', lease, holder, 'PX', ttl_ms)
  if current == holder then return 2 end
  return 1
end
return 0
