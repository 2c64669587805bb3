-- start: a worker takes a job (or takes over one another worker began).
-- KEYS: 1 job hash, 2 dequeued counter
-- ARGV: 1 now (unix s), 2 worker id
-- Returns {code, seq, created_at}: code 1 started, 2 already running (a redelivery: resume from seq),
--   0 ended or cancel requested, -1 no such job.
local job, dequeued = KEYS[1], KEYS[2]
local now, worker = ARGV[1], ARGV[2]
local st = redis.call('HGET', job, 'status')
if not st then return {-1, 0, ''} end
local seq = tonumber(redis.call('HGET', job, 'seq') or '0')
local created = redis.call('HGET', job, 'created_at') or ''
if redis.call('HGET', job, 'cancel_requested') == '1' then return {0, seq, created} end
if st == 'queued' then
  redis.call('HSET', job, 'status', 'running', 'started_at', now, 'worker', worker)
  redis.call('INCR', dequeued)
  return {1, seq, created}
end
if st == 'running' then
  redis.call('HSET', job, 'worker', worker)
  return {2, seq, created}
end
return {0, seq, created}
