-- note_failure: note why a job's last webhook delivery failed, as `webhook_error` on its record.
-- KEYS: 1 job hash
-- ARGV: 1 the reason
-- An expired record is not brought back. Returns nothing.
local job, why = KEYS[1], ARGV[1]
if redis.call('EXISTS', job) == 1 then redis.call('HSET', job, 'webhook_error', why) end
