-- claim: fence a chunk message against the job's record and mark the job RUNNING on the
-- claiming worker; the worker reads nothing else before it runs.
--
-- KEYS: job, events, ckpt, changes
-- ARGV: chunk, epoch, worker, now, lease_s, held_seq, held_commit
-- Needs: lifecycle, _events
--
-- job       hash    the job record (sl:job:<id>)
-- events    stream  the job's event stream (sl:job:<id>:events)
-- ckpt      string  the job's durable checkpoint (sl:job:<id>:ckpt)
-- changes   stream  the change stream the tick folds (sl:changes)
-- chunk     int     the chunk the message runs
-- epoch     int     the message's epoch (a requeue starts a new one)
-- worker    string  the claiming worker
-- now       string  the worker's clock, seconds since the epoch
-- lease_s   number  how long the claim holds without a renewal
-- held_seq  string  the sequence number of the job's state the worker holds in memory
--                   ('': it wants no checkpoint; -1: it holds none)
-- held_commit string the id of the commit that made the state it holds (the record's
--                   commit_id): a sequence number alone may name two states, the one of a
--                   commit a failover lost and the one its replay reached
--
-- Returns {'stale', why}, {'missing'}, or {'ok', the record as claimed (HGETALL)} and, unless
-- the worker holds the job's state (both its seq and its commit id; or there is none yet,
-- sequence 0), the checkpoint.

local job = KEYS[1]
local events = KEYS[2]
local ckpt = KEYS[3]
local changes = KEYS[4]
local chunk = ARGV[1]
local epoch = ARGV[2]
local worker = ARGV[3]
local now = ARGV[4]
local lease_s = ARGV[5]
local held_seq = ARGV[6]
local held_commit = ARGV[7]

if redis.call('EXISTS', job) == 0 then return {'missing'} end
local h = redis.call('HMGET', job, 'state', 'epoch', 'next_chunk', 'num_chunks')
local state = h[1]
if state ~= STATE.QUEUED and state ~= STATE.RUNNING then return {'stale', 'state ' .. state} end
if h[2] ~= epoch then return {'stale', 'epoch ' .. h[2] .. ' != ' .. epoch} end
if h[3] ~= chunk then return {'stale', 'next chunk ' .. h[3] .. ' != ' .. chunk} end
if tonumber(chunk) >= tonumber(h[4]) then
  return {'stale', 'chunk ' .. chunk .. ' past the last (' .. h[4] .. ' chunks)'}
end
redis.call('HSET', job, 'state', STATE.RUNNING, 'running_on', worker,
           'chunk_started_at', now, 'lease_until', now + lease_s, 'updated_at', now)
if redis.call('HEXISTS', job, 'started_at') == 0 then
  redis.call('HSET', job, 'started_at', now)
end
changed(changes, job)
if state ~= STATE.RUNNING then
  event(events, 'state', state, STATE.RUNNING, worker, 'chunk ' .. chunk, now)
end
local record = redis.call('HGETALL', job)
local seq, commit_id = unpack(redis.call('HMGET', job, 'seq', 'commit_id'))
if held_seq == '' or seq == '0' or (seq == held_seq and commit_id == held_commit) then
  return {'ok', record}
end
return {'ok', record, redis.call('GET', ckpt)}
