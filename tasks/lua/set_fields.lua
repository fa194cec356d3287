-- set_fields: write fields of a job record and mark the write (no fence: a blind write, such as
-- the tick's level marks or a worker's note).
--
-- KEYS: job, changes
-- ARGV: fields
-- Needs: _events
--
-- job      hash    the job record (sl:job:<id>)
-- changes  stream  the change stream the tick folds (sl:changes)
-- fields   JSON    the fields to write: [field, value, ...]
--
-- Returns the record's revision after the write (its mark carries it).

local job = KEYS[1]
local changes = KEYS[2]
local fields = cjson.decode(ARGV[1])

if #fields > 0 then redis.call('HSET', job, unpack(fields)) end
return changed(changes, job)
