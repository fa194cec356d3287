-- count_live: rebuild the live counters from the records of the live set, in one step.
--
-- KEYS: active, by_state, by_tenant, ran
-- ARGV: job_prefix
-- Needs: lifecycle
--
-- active      set     ids of jobs not yet terminal (sl:jobs:active)
-- by_state    hash    unfinished jobs per 'STATE|slo' (sl:jobs:live:state)
-- by_tenant   hash    unfinished jobs per tenant (sl:jobs:live:tenant)
-- ran         zset    jobs by when they last left RUNNING, +inf while running (sl:jobs:ran)
-- job_prefix  string  the job record key without the id (sl:job:)
--
-- Every 'state' event keeps them up to date (_events.lua); this sets them to a full count (for
-- a process starting against a store written before the counters existed). Returns the number
-- of unfinished jobs counted.

local active = KEYS[1]
local by_state = KEYS[2]
local by_tenant = KEYS[3]
local ran = KEYS[4]
local job_prefix = ARGV[1]

local states, tenants, running, n = {}, {}, {}, 0
for _, id in ipairs(redis.call('SMEMBERS', active)) do
  local h = redis.call('HMGET', job_prefix .. id, 'state', 'slo', 'tenant')
  if h[1] and not TERMINAL[h[1]] then
    local key = h[1] .. '|' .. (h[2] or '')
    states[key] = (states[key] or 0) + 1
    tenants[h[3] or ''] = (tenants[h[3] or ''] or 0) + 1
    if h[1] == STATE.RUNNING then running[#running + 1] = id end
    n = n + 1
  end
end
redis.call('DEL', by_state, by_tenant)
for key, count in pairs(states) do redis.call('HSET', by_state, key, count) end
for key, count in pairs(tenants) do redis.call('HSET', by_tenant, key, count) end
redis.call('ZREMRANGEBYSCORE', ran, 'inf', 'inf')
for _, id in ipairs(running) do redis.call('ZADD', ran, 'inf', id) end
return n
