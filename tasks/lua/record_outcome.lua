-- record_outcome: one chunk's outcome on an expert version, kept only while an update of the
-- model is in progress (its step key exists).
--
-- KEYS: step
-- ARGV: stats_prefix, version, outcome, ttl_s
--
-- step          string  the update's current step (sl:experts:<model>:step)
-- stats_prefix  string  the outcome lists' key without step and version
--                       (sl:experts:<model>:stats:)
-- version       string  the version the chunk ran on
-- outcome       string  '<1 ok | 0 failed>:<latency ms>'
-- ttl_s         int     how long the step's outcomes are kept
--
-- Returns 1 when recorded, 0 when no update is in progress.

local step = KEYS[1]
local stats_prefix = ARGV[1]
local version = ARGV[2]
local outcome = ARGV[3]
local ttl_s = ARGV[4]

local current = redis.call('GET', step)
if not current then return 0 end
local key = stats_prefix .. current .. ':' .. version
redis.call('RPUSH', key, outcome)
redis.call('EXPIRE', key, ttl_s)
return 1
