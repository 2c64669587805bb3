-- start: a worker takes a job (or takes over one another worker began).
-- KEYS: 1 job hash, 2 dequeued counter
-- ARGV: 1 now (unix s), 2 worker id, 3 the record's ttl (s): a job taken counts its ttl afresh, so a job that
--   waited in its queue for most of JOB_TTL_S is not lost while it runs
-- Returns {code, seq, created_at, tenant, weight, owner}: code 1 started, 2 already running (a redelivery: resume
--   from seq), 0 ended, 3 not ended but its cancel was requested (its engine died before it stopped it: the
--   caller ends it cancelled), -1 no such job (nothing written); tenant: the fair-queue tenant its generated
--   tokens are charged to ('' none), weight: that tenant's; owner: the record's ('' none), whose keys a finish
--   names (finish.lua).
local job, dequeued = KEYS[1], KEYS[2]
local now, worker, ttl = ARGV[1], ARGV[2], ARGV[3]
local st = redis.call('HGET', job, 'status')
if not st then return {-1, 0, '', '', '1', ''} end
local seq = tonumber(redis.call('HGET', job, 'seq') or '0')
local rec = redis.call('HMGET', job, 'created_at', 'cancel_requested', 'fair_queued', 'weight', 'owner', 'counted')
local created, tenant, weight, owner = rec[1] or '', rec[3] or '', rec[4] or '1', rec[5] or ''
if rec[2] == '1' then
  return {(st == 'queued' or st == 'running') and 3 or 0, seq, created, tenant, weight, owner}
end
if st == 'queued' then
  redis.call('HSET', job, 'status', 'running', 'started_at', now, 'worker', worker)
  redis.call('EXPIRE', job, ttl)
  if rec[6] ~= '0' then redis.call('INCR', dequeued) end -- a batch line never counted in the depth (submit.lua)
  return {1, seq, created, tenant, weight, owner}
end
if st == 'running' then
  redis.call('HSET', job, 'worker', worker)
  redis.call('EXPIRE', job, ttl)
  return {2, seq, created, tenant, weight, owner}
end
return {0, seq, created, tenant, weight, owner}
