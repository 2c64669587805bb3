-- fair_push: tokenized jobs into their tenants' queues (the fair queue in front of the `tokenized`
-- stream; shared/fair_queue.py), and the `jobs` entries they came from acknowledged, in one step.
-- KEYS: 1 backlogged tenants (zset: virtual counter), 2 virtual counters (hash), 3 payloads (hash: job id ->
--       its one-row tokenized record batch), 4 arrival counter, 5 doorbell (list), 6 the `jobs` stream,
--       7 the waiting jobs (zset, every score 0: members '<tenant>:<order>:<job id>'), 8 the same by submit
--       time (zset, every score 0: '<tenant>:<created at, ms, 13 digits>:<job id>'), 9 each waiting job's
--       place (hash: job id -> '<order>:<created at, ms>:<prompt tokens>:<weight>'), 10 the ring flag of the
--       model's inference workers (shared/ring.py), 11.. the jobs' hashes, one per job, in ARGV's order
-- ARGV: 1 the tokenizers' group, 2 '1': by tenant, '0': every job in one queue (first in, first out by
--       priority), 3 the records' ttl (s; 0 leaves it: a job queued counts its ttl afresh), 4 how many `jobs`
--       entry ids follow, then those ids, then 4 per job: job id, priority (lower runs first), prompt tokens,
--       payload
-- A job's order is its priority (offset by 1000, shared/limits.py's PRIORITY_MIN: 4 hex digits), then its
-- arrival (11 hex digits): a tenant's members sort by both, and a tenant's next job is the first member from
-- '<tenant>:' (tenant names hold no ':').
-- A job is queued once: only while its record is `queued`, not cancelled and not queued before (a replayed
-- call queues nothing twice). A tenant that was not backlogged has its counter lifted to the smallest
-- counter among the backlogged ones: idle time banks no credit (Sheng et al., OSDI 2024, the Virtual
-- Token Counter). A job's tenant is its record's owner ('_' for jobs without one); the record keeps the
-- tenant whose queue holds it (`fair_queued`).
-- Returns how many jobs were queued.
local backlog, counters, payloads, arrivals, bell, jobs = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local queue, ages, places, flag = KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local group, by_tenant, ttl, n_ack = ARGV[1], ARGV[2] == '1', tonumber(ARGV[3]), tonumber(ARGV[4])
local PRIORITY_BASE = 1000
local function ring(flag) -- a consumer of this partition sleeps: wake it (shared/ring.py)
  local channel = redis.call('GETDEL', flag)
  if channel then redis.call('PUBLISH', channel, flag) end
end
local queued, k = 0, 11
for i = 5 + n_ack, #ARGV, 4 do
  local job_id, priority, prompt_tokens, payload = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3]
  local job = KEYS[k]
  k = k + 1
  local rec = redis.call('HMGET', job, 'status', 'cancel_requested', 'fair_queued', 'owner', 'created_at', 'weight')
  if rec[1] == 'queued' and rec[2] ~= '1' and not rec[3] then
    local tenant = (by_tenant and rec[4] and rec[4] ~= '') and rec[4] or '_'
    if not redis.call('ZSCORE', backlog, tenant) then
      local own = tonumber(redis.call('HGET', counters, tenant) or '0')
      local least = redis.call('ZRANGE', backlog, 0, 0, 'WITHSCORES')
      if least[2] and tonumber(least[2]) > own then own = tonumber(least[2]) end
      redis.call('HSET', counters, tenant, own)
      redis.call('ZADD', backlog, own, tenant)
    end
    local order = string.format('%04x%011x', priority + PRIORITY_BASE, redis.call('INCR', arrivals))
    local created = string.format('%013d', math.floor((tonumber(rec[5]) or 0) * 1000))
    redis.call('ZADD', queue, 0, tenant .. ':' .. order .. ':' .. job_id)
    redis.call('ZADD', ages, 0, tenant .. ':' .. created .. ':' .. job_id)
    redis.call('HSET', places, job_id, order .. ':' .. created .. ':' .. prompt_tokens .. ':' .. (rec[6] or '1'))
    redis.call('HSET', payloads, job_id, payload)
    redis.call('HSET', job, 'fair_queued', tenant, 'prompt_tokens', prompt_tokens)
    if ttl > 0 then redis.call('EXPIRE', job, ttl) end
    queued = queued + 1
  end
end
if n_ack > 0 then redis.call('XACK', jobs, group, unpack(ARGV, 5, 4 + n_ack)) end
if queued > 0 then
  redis.call('LPUSH', bell, 1)
  redis.call('LTRIM', bell, 0, 0)
  ring(flag)
end
return queued
