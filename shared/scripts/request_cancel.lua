-- request_cancel: ask the engine that runs a job to stop it (a queued job is ended by finish.lua instead).
-- KEYS: 1 job hash
-- ARGV: 1 the control channel, 2 job id
-- Marks a running job `cancel_requested` and publishes {op = 'cancel', job_id} on the control channel.
-- Returns the job's status before the request ('' if it does not exist, or its record is a key of another type:
-- damaged by hand, which the API's read of it answers).
local job = KEYS[1]
local control, job_id = ARGV[1], ARGV[2]
local st = redis.pcall('HGET', job, 'status')
if not st or type(st) == 'table' then return '' end
if st == 'running' then
  redis.call('HSET', job, 'cancel_requested', '1')
  redis.call('PUBLISH', control, cjson.encode({op = 'cancel', job_id = job_id}))
end
return st
