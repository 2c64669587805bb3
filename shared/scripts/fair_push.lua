-- fair_push: tokenized jobs into their tenants' queues (the fair queue in front of the `tokenized`
-- stream; shared/fair_queue.py), and the `jobs` entries they came from acknowledged, in one step.
-- KEYS: 1 backlogged tenants (zset: virtual counter), 2 virtual counters (hash), 3 payloads (hash: job id ->
--       its one-row tokenized record batch), 4 arrival counter, 5 doorbell (list), 6 the `jobs` stream
-- ARGV: 1 the tokenizers' group, 2 the partition's key prefix, 3 '1': by tenant, '0': every job in one queue
--       (first in, first out by priority), 4 how many `jobs` entry ids follow, then those ids, then 4 per
--       job: job id, priority (lower runs first), prompt tokens, payload
-- A job is queued once: only while its record is `queued`, not cancelled and not queued before (a replayed
-- call queues nothing twice). A tenant that was not backlogged has its counter lifted to the smallest
-- counter among the backlogged ones: idle time banks no credit (Sheng et al., OSDI 2024, the Virtual
-- Token Counter). A job's tenant is its record's owner ('_' for jobs without one); the record keeps the
-- tenant whose queue holds it (`fair_queued`); the tenant's age set holds its waiting jobs by submit time.
-- Returns how many jobs were queued.
local backlog, counters, payloads, arrivals, bell, jobs = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local group, prefix, by_tenant, n_ack = ARGV[1], ARGV[2], ARGV[3] == '1', tonumber(ARGV[4])
local SPAN = 2199023255552 -- 2^41 arrivals per priority level: score = priority * SPAN + arrival
local queued = 0
for i = 5 + n_ack, #ARGV, 4 do
  local job_id, priority, prompt_tokens, payload = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3]
  local job = prefix .. ':job:' .. job_id
  local rec = redis.call('HMGET', job, 'status', 'cancel_requested', 'fair_queued', 'owner', 'created_at')
  if rec[1] == 'queued' and rec[2] ~= '1' and not rec[3] then
    local tenant = (by_tenant and rec[4] and rec[4] ~= '') and rec[4] or '_'
    local queue = prefix .. ':fair:q:' .. tenant
    if not redis.call('ZSCORE', backlog, tenant) then
      local own = tonumber(redis.call('HGET', counters, tenant) or '0')
      local least = redis.call('ZRANGE', backlog, 0, 0, 'WITHSCORES')
      if least[2] and tonumber(least[2]) > own then own = tonumber(least[2]) end
      redis.call('HSET', counters, tenant, own)
      redis.call('ZADD', backlog, own, tenant)
    end
    redis.call('ZADD', queue, priority * SPAN + redis.call('INCR', arrivals), job_id)
    redis.call('HSET', payloads, job_id, payload)
    redis.call('ZADD', prefix .. ':fair:age:' .. tenant, tonumber(rec[5]) or 0, job_id)
    redis.call('HSET', job, 'fair_queued', tenant, 'prompt_tokens', prompt_tokens)
    queued = queued + 1
  end
end
if n_ack > 0 then redis.call('XACK', jobs, group, unpack(ARGV, 5, 4 + n_ack)) end
if queued > 0 then
  redis.call('LPUSH', bell, 1)
  redis.call('LTRIM', bell, 0, 0)
end
return queued
