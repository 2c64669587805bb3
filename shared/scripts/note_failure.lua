-- note_failure: note why a job's (or a batch's) last webhook delivery failed, as `webhook_error` on its record.
-- KEYS: 1 the job's (or batch's) hash
-- ARGV: 1 the reason
-- An expired record is not brought back: nothing is written.
-- Returns 1 noted, -1 when the record has expired.
local record, why = KEYS[1], ARGV[1]
if redis.call('EXISTS', record) == 0 then return -1 end
redis.call('HSET', record, 'webhook_error', why)
return 1
