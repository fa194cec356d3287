-- tick_lease: take or renew the tick lease; another live scheduler keeps it until it stops
-- ticking (one tick runs at a time cluster-wide).
--
-- KEYS: lease, last
-- ARGV: holder, ttl_ms
--
-- lease   string  the scheduler worker holding the tick (sl:tick:lease)
-- last    string  the last scheduler that took the lease, kept without expiry
--                 (sl:tick:last_holder)
-- holder  string  the worker asking for it
-- ttl_ms  int     how long the lease lives without a renewal
--
-- Returns 2 when ``holder`` held the lease and renewed it, or took back a lease that lapsed
-- while nobody else took it (a tick longer than the lease's life: no other scheduler has ticked
-- since, so what it kept is still good); 1 when it took it from another (or from nothing it
-- knows: another scheduler may have ticked meanwhile); 0 when another holds it.

local lease = KEYS[1]
local last = KEYS[2]
local holder = ARGV[1]
local ttl_ms = ARGV[2]

local current = redis.call('GET', lease)
if current == false or current == holder then
  redis.call('SET', lease, holder, 'PX', ttl_ms)
  if current == holder then return 2 end
  if redis.call('GET', last) == holder then return 2 end
  redis.call('SET', last, holder)
  return 1
end
return 0
