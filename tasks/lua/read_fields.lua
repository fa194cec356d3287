-- read_fields: named fields of many hashes in one command (the API reads a few fields of
-- hundreds of job records per request: one reply instead of one command per record).
--
-- KEYS: hashes
-- ARGV: fields
--
-- hashes  hash    the records to read (sl:job:<id>, ...), any number of them
-- fields  string  the field names, any number of them
--
-- Returns one list per hash: its fields' values in order (nil for a missing one).

local hashes = KEYS
local fields = ARGV

local out = {}
for i, hash in ipairs(hashes) do
  out[i] = redis.call('HMGET', hash, unpack(fields))
end
return out
