-- transition: move a job to a target state if the lifecycle allows it from the job's current
-- state and every fenced field still holds what the writer saw.
--
-- KEYS: job, events, active, done, changes, queue
-- ARGV: target, now, by, reason, options, message
-- Needs: lifecycle, _events
--
-- job      hash    the job record (sl:job:<id>)
-- events   stream  the job's event stream (sl:job:<id>:events)
-- active   set     ids of jobs not yet terminal (sl:jobs:active)
-- done     stream  (id, final state) of every job that ended (sl:done)
-- changes  stream  the change stream the tick folds (sl:changes)
-- queue    list    where ``message`` goes (a Celery queue's list); '' without one
-- target   string  the state to move to (a JobState value)
-- now      string  the writer's clock, seconds since the epoch
-- by       string  who moves the job (a worker, the scheduler, the client)
-- reason   string  why, for the event stream
-- options  JSON    {"expect": {field: value, ...}, "set": [field, value, ...]}, both optional:
--                  fields that must hold these values (an absent field reads as ""), and
--                  fields written with the move
-- message  string  a task message pushed onto ``queue`` with the move ('' for none): a release
--                  publishes its chunk in the same step (the record's note of it in ``set``)
--
-- Returns {'ok', previous state, revision} (the record's revision after the move, which its
-- mark carries), {'missing', ''}, {'illegal', current state} or {'fenced', current state}.

local job = KEYS[1]
local events = KEYS[2]
local active = KEYS[3]
local done = KEYS[4]
local changes = KEYS[5]
local queue = KEYS[6]
local target = ARGV[1]
local now = ARGV[2]
local by = ARGV[3]
local reason = ARGV[4]
local options = cjson.decode(ARGV[5])
local message = ARGV[6]

if redis.call('EXISTS', job) == 0 then return {'missing', ''} end
local cur = redis.call('HGET', job, 'state')
if not SOURCES[target][cur] then return {'illegal', cur} end
for field, value in pairs(options.expect or {}) do
  if (redis.call('HGET', job, field) or '') ~= value then return {'fenced', cur} end
end
local set = options.set or {}
if #set > 0 then redis.call('HSET', job, unpack(set)) end
redis.call('HSET', job, 'state', target, 'updated_at', now)
if TERMINAL[target] then
  ended(job, active, done, redis.call('HGET', job, 'id'), target, now)
end
if message ~= '' then redis.call('LPUSH', queue, message) end
local rev = changed(changes, job)
event(events, 'state', cur, target, by, reason, now)
return {'ok', cur, rev}
