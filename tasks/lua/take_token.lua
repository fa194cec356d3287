-- take_token: spend submission tokens of a tenant's token bucket, on Redis's own clock so
-- every API process agrees: all of them, or none (a batch submit is one decision).
--
-- KEYS: bucket
-- ARGV: rate_per_s, burst, count
--
-- bucket      hash    the tenant's token bucket (sl:tenant:<name>:bucket): tokens, ts
-- rate_per_s  number  tokens added per second
-- burst       int     the bucket's size
-- count       int     tokens to take (at most burst)
--
-- Returns 0, or the seconds until that many tokens are available (as a string).

local bucket = KEYS[1]
local rate_per_s = ARGV[1]
local burst = ARGV[2]
local count = ARGV[3]

local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rate, size, want = tonumber(rate_per_s), tonumber(burst), tonumber(count)
local h = redis.call('HMGET', bucket, 'tokens', 'ts')
local tokens, ts = tonumber(h[1]) or size, tonumber(h[2]) or now
tokens = math.min(size, tokens + math.max(0, now - ts) * rate)
local wait = 0
if tokens >= want then tokens = tokens - want else wait = (want - tokens) / rate end
redis.call('HSET', bucket, 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('EXPIRE', bucket, math.ceil(size / rate) + 60)
return tostring(wait)
