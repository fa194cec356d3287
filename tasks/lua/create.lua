-- create: store a new PENDING job, once per idempotency key.
--
-- KEYS: job, events, active, index, idem, changes
-- ARGV: id, now, fields, note
-- Needs: lifecycle, _events
--
-- job     hash    the new job's record (sl:job:<id>)
-- events  stream  its event stream (sl:job:<id>:events)
-- active  set     ids of jobs not yet terminal (sl:jobs:active)
-- index   zset    every job id by submit time (sl:jobs:index)
-- idem    string  the tenant's idempotency key (sl:idem:<tenant>:<key>, kept 24 h), or '' for
--                 none
-- changes  stream  the change stream the tick folds (sl:changes)
-- id      string  the new job's id
-- now     string  the submit time, seconds since the epoch
-- fields  JSON    the record: [field, value, ...]
-- note    string  the reason of its first event ("accepted", and how admission degraded it)
--
-- Returns {'ok', id}, or {'exists', the first job's id} for an idempotency key seen before.

local job = KEYS[1]
local events = KEYS[2]
local active = KEYS[3]
local index = KEYS[4]
local idem = KEYS[5]
local changes = KEYS[6]
local id = ARGV[1]
local now = ARGV[2]
local fields = cjson.decode(ARGV[3])
local note = ARGV[4]

if idem ~= '' then
  local existing = redis.call('GET', idem)
  if existing then return {'exists', existing} end
  redis.call('SET', idem, id, 'EX', 86400)
end
redis.call('HSET', job, unpack(fields))
redis.call('SADD', active, id)
redis.call('ZADD', index, now, id)
changed(changes, job)
event(events, 'state', '', STATE.PENDING, 'submit', note, now)
return {'ok', id}
