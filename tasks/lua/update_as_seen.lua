-- update_as_seen: write fields of a job only while it is as the writer saw it.
--
-- KEYS: job, changes
-- ARGV: state, epoch, seq, fields
-- Needs: _events
--
-- job     hash    the job record (sl:job:<id>)
-- changes stream  the change stream the tick folds (sl:changes)
-- state   string  the state the writer saw
-- epoch   int     the epoch the writer saw
-- seq     int     the sequence number the writer saw
-- fields  JSON    the fields to write: [field, value, ...]
--
-- Returns the record's revision after the write (>= 1: the write's mark carries it), 0 when
-- the job moved on.

local job = KEYS[1]
local changes = KEYS[2]
local state = ARGV[1]
local epoch = ARGV[2]
local seq = ARGV[3]
local fields = cjson.decode(ARGV[4])

local h = redis.call('HMGET', job, 'state', 'epoch', 'seq')
if h[1] ~= state or h[2] ~= epoch or h[3] ~= seq then return 0 end
if #fields > 0 then redis.call('HSET', job, unpack(fields)) end
return changed(changes, job)
