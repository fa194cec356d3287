-- commit: compare-and-set a job's cursor after one chunk and take the job's next step in the
-- same script, so no other writer can slip between a job's last commit and its end: the last
-- chunk's commit is its DONE, a flagged job stops, any other job hops to its next chunk's queue
-- (or, atomic, keeps running). A hop given the next chunk's message pushes it onto the chosen
-- queue's list, as kombu's Redis transport would (priority 0: the queue's own list), and
-- records it published: the commit, the publish and its bookkeeping are one round trip.
--
-- KEYS: job, ckpt, events, active, done, timings, changes, fair
-- ARGV: chunk, epoch, seq, complete, has_ckpt, checkpoint, service_s, now, worker, task_id,
--       options, commit_id
-- Needs: lifecycle, _events
--
-- job         hash    the job record (sl:job:<id>)
-- ckpt        string  the job's durable checkpoint (sl:job:<id>:ckpt)
-- events      stream  the job's event stream (sl:job:<id>:events)
-- active      set     ids of jobs not yet terminal (sl:jobs:active)
-- done        stream  (id, final state) of every job that ended (sl:done)
-- timings     stream  measured seconds per cost unit of each chunk (sl:timings)
-- changes     stream  the change stream the tick folds (sl:changes); a commit's entry
--                     carries its seq, chunk and service_s (the job's own chunk times)
-- fair        hash    measured worker-seconds per "band<TAB>tenant<TAB>tier" (sl:fair:service,
--                     the tenants' fair-share counters: scheduler.fairness)
-- chunk       int     the chunk that ran
-- epoch       int     the epoch it was claimed at
-- seq         int     the sequence number it was claimed at
-- complete    '1'|'0' the chunk ran to its end ('0': it yielded inside; the job stops)
-- has_ckpt    '1'|'0' the commit carries a durable checkpoint
-- checkpoint  bytes   the checkpoint, or a reference to it in the object store
--                     (REFERENCE_MAGIC .. JSON, tasks.checkpoint_objects); '' without one
-- service_s   string  worker seconds charged to the job
-- now         string  the worker's clock, seconds since the epoch
-- worker      string  the committing worker
-- task_id     string  the chunk's task id
-- options     JSON    every key optional:
--                     "then_continue": true    an atomic job stays RUNNING on this worker
--                     "artifact": [name, media type]   the last chunk's stored output
--                     "timing": {"device", "s_per_unit", "cost_key"}   a cost-model sample
--                               (the job's own cost key when "cost_key" is absent)
--                     "hop_queues": {class queue: queue}   where this worker sends the next
--                               chunk of a class (a class not named: its class queue)
--                     "next_message": {"task_id", "before", "after"}   the next chunk's
--                               message, pushed as before .. <queue as JSON> .. after on a hop
--                     "yielded": true   the chunk stopped inside (complete '0') for work its
--                               worker takes first, not for a flag: unless a flag is raised the
--                               job stays in flight and hops with the same next chunk, resumed
--                               from the checkpoint (which it must carry)
-- commit_id   string  this commit's id, unique (the worker's): the record keeps it as the id
--                     of the state the job is at. A commit a failover loses is replayed, and
--                     the replay may reach the same seq with another state (a chunk stopped
--                     inside advances seq, not next_chunk); the claim hands the checkpoint to
--                     a worker unless both the seq and this id of the state it holds match
--
-- Returns {'stale'}, {'needs_checkpoint'} (the job must stop here: send one), or {status, seq,
-- next chunk, queue, published task id, replaced reference} with status 'done', 'cancelled',
-- 'preempted', 'continue' or 'hop' ('' for a queue or task id not there; the replaced
-- reference is the object-store reference this commit's checkpoint took the place of, '' when
-- none: its object may go).

local job = KEYS[1]
local ckpt = KEYS[2]
local events = KEYS[3]
local active = KEYS[4]
local done = KEYS[5]
local timings = KEYS[6]
local changes = KEYS[7]
local fair = KEYS[8]
local chunk = ARGV[1]
local epoch = ARGV[2]
local seq = ARGV[3]
local complete = ARGV[4]
local has_ckpt = ARGV[5]
local checkpoint = ARGV[6]
local service_s = ARGV[7]
local now = ARGV[8]
local worker = ARGV[9]
local task_id = ARGV[10]
local options = cjson.decode(ARGV[11])
local commit_id = ARGV[12]
local REFERENCE_MAGIC = 'slckref:'

local h = redis.call('HMGET', job, 'state', 'epoch', 'seq', 'next_chunk', 'num_chunks',
                     'preempt', 'cancel', 'queue', 'preemptions', 'id', 'cost_key', 'slo',
                     'tenant', 'tier')
if h[1] ~= STATE.RUNNING or h[2] ~= epoch or h[3] ~= seq or h[4] ~= chunk then
  return {'stale'}
end
local nxt, total = tonumber(h[4]), tonumber(h[5])
if nxt >= total then return {'stale'} end
local ran_whole = complete == '1'
if ran_whole then nxt = nxt + 1 end
local last = ran_whole and nxt == total
local cancel = h[7] == '1'
local yielded = not ran_whole and options.yielded == true
local stop = cancel or h[6] == '1' or (not ran_whole and not yielded)
if (stop or yielded) and not last and has_ckpt ~= '1' then return {'needs_checkpoint'} end
local new_seq = tonumber(seq) + 1
redis.call('HSET', job, 'seq', new_seq, 'next_chunk', nxt, 'commit_id', commit_id,
           'updated_at', now)
redis.call('HINCRBYFLOAT', job, 'service_s', service_s)
redis.call('HINCRBYFLOAT', fair, (h[12] or '') .. '\t' .. (h[13] or '') .. '\t' .. (h[14] or ''),
           service_s)
local replaced = ''
if has_ckpt == '1' then
  if redis.call('GETRANGE', ckpt, 0, #REFERENCE_MAGIC - 1) == REFERENCE_MAGIC then
    replaced = redis.call('GET', ckpt)
  end
  redis.call('SET', ckpt, checkpoint)
  redis.call('HSET', job, 'ckpt_seq', new_seq, 'ckpt_chunk', nxt)
end
redis.call('XADD', events, '*', 'kind', 'commit', 'chunk', chunk, 'complete', complete,
           'seq', new_seq, 'by', worker, 'task', task_id, 'service_s', service_s, 'ts', now)
changed(changes, job, 'seq', new_seq, 'chunk', chunk, 'service_s', service_s)
local timing = options.timing
if ran_whole and timing then
  redis.call('XADD', timings, 'MAXLEN', '~', 10000, '*', 'cost_key', timing.cost_key or h[11],
             'device', timing.device, 's_per_unit', timing.s_per_unit)
end
local function reply(status, queue, published)
  return {status, tostring(new_seq), tostring(nxt), queue or '', published or '', replaced}
end
if last then
  redis.call('HSET', job, 'state', STATE.DONE, 'preempt', '0')
  local artifact = options.artifact
  if artifact and artifact[1] ~= '' then
    redis.call('HSET', job, 'artifact', artifact[1], 'media_type', artifact[2])
  end
  ended(job, active, done, h[10], STATE.DONE, now)
  event(events, 'state', STATE.RUNNING, STATE.DONE, worker, 'all chunks ran', now)
  return reply('done')
end
if cancel then
  redis.call('HSET', job, 'state', STATE.CANCELLED)
  ended(job, active, done, h[10], STATE.CANCELLED, now)
  event(events, 'state', STATE.RUNNING, STATE.CANCELLED, worker, 'cancelled by client', now)
  return reply('cancelled')
end
if stop then
  redis.call('HSET', job, 'state', STATE.PREEMPTED, 'preempt', '0', 'preempted_at', now,
             'preemptions', tonumber(h[9] or '0') + 1)
  event(events, 'state', STATE.RUNNING, STATE.PREEMPTED, worker, 'preempt flag', now)
  return reply('preempted')
end
if options.then_continue then return reply('continue') end
-- the class behind the job's queue: 'interactive' for it, w.interactive or w.interactive.placed
local class = string.match((string.gsub(h[8], '%.placed$', '')), '([^.]+)$')
local target = (options.hop_queues or {})[class] or class
redis.call('HSET', job, 'state', STATE.QUEUED, 'queue', target, 'queued_at', now)
local why = 'next chunk ' .. nxt .. ' on ' .. target
if yielded then why = 'yielded inside chunk ' .. nxt .. ' to waiting work; resumes on ' .. target end
event(events, 'state', STATE.RUNNING, STATE.QUEUED, worker, why, now)
local message = options.next_message
if not message or message.task_id == '' then
  return reply('hop', target)
end
redis.call('LPUSH', target, message.before .. cjson.encode(target) .. message.after)
redis.call('HSET', job, 'published', nxt, 'last_task_id', message.task_id)
return reply('hop', target, message.task_id)
