-- account: add an ended job's tokens to the day's usage, once (the job's `accounted` field marks it done).
-- KEYS: 1 job hash, 2 the day's usage hash
-- ARGV: 1 ttl of the usage hash (s)
-- An expired record is not brought back: nothing is written.
-- Returns {1, webhook URL, owner} ('' for none) once its usage is counted (now, or by an earlier call), or
--   {-1} when the record has expired.
local job, usage = KEYS[1], KEYS[2]
local usage_ttl = ARGV[1]
if redis.call('EXISTS', job) == 0 then return {-1} end
if redis.call('HSETNX', job, 'accounted', '1') == 1 then
  local rec = redis.call('HMGET', job, 'model', 'prompt_tokens', 'completion_tokens')
  local model = rec[1] or ''
  redis.call('HINCRBY', usage, model .. ':prompt_tokens', tonumber(rec[2] or '0') or 0)
  redis.call('HINCRBY', usage, model .. ':completion_tokens', tonumber(rec[3] or '0') or 0)
  redis.call('HINCRBY', usage, model .. ':jobs', 1)
  redis.call('EXPIRE', usage, usage_ttl)
end
local rec = redis.call('HMGET', job, 'webhook_url', 'owner')
return {1, rec[1] or '', rec[2] or ''}
