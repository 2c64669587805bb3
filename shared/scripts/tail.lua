-- tail: the job ids of a stream's newest entries, without sending the entries (those of `jobs` carry
-- whole requests).
-- KEYS: 1 a stream whose entries carry a `job_id` field
-- ARGV: 1 how many of the newest entries
-- Returns the newest entry's id ('0-0' for an empty stream), then those entries' job ids, newest first.
local entries = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', ARGV[1])
local out = {entries[1] and entries[1][1] or '0-0'}
for _, e in ipairs(entries) do
  local f = e[2]
  for i = 1, #f, 2 do
    if f[i] == 'job_id' then out[#out + 1] = f[i + 1]; break end
  end
end
return out
