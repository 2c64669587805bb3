-- file_bytes: the bytes of a tenant's stored files, all told; and, when asked, add one file's within a cap
-- (api/files.py: an upload against the tenant's max_file_bytes, a batch's results whatever the total).
-- KEYS: 1 the tenant's sizes hash (names.file_bytes_key: file id -> "<bytes>:<expires at, unix s>")
-- ARGV: 1 now (unix s), 2 file id ('' only count), 3 its bytes, 4 when it expires (unix s), 5 the cap (0 none)
-- Entries of files past their expiry are dropped first, so the total follows the files' TTLs; a deleted
-- file's entry is deleted with it (HDEL).
-- Returns {1, total} counted, or the file added (total with it); {0, total} the file would pass the cap.
local key = KEYS[1]
local now, file_id, size = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local expires, cap = tonumber(ARGV[4]), tonumber(ARGV[5])
local total = 0
local all = redis.call('HGETALL', key)
for i = 1, #all, 2 do
  local v = all[i + 1]
  local sep = string.find(v, ':', 1, true)
  if tonumber(string.sub(v, sep + 1)) <= now then
    redis.call('HDEL', key, all[i])
  else
    total = total + tonumber(string.sub(v, 1, sep - 1))
  end
end
if file_id == '' then return {1, total} end
if cap > 0 and total + size > cap then return {0, total} end
redis.call('HSET', key, file_id, string.format('%d:%d', size, expires))
if redis.call('TTL', key) < expires - now then redis.call('EXPIREAT', key, expires) end
return {1, total + size}
