-- submit: admit and enqueue a job in one atomic step: an idempotent replay, the tenant's limits, the
-- service-wide queue cap, then the record (with its tenant's fair-share weight), its queue ordinal and the
-- `jobs` entry. A refusal stores nothing.
-- KEYS: 1 job hash, 2 jobs stream, 3 submitted counter, 4 dequeued counter, 5 tenant hash,
--       6 tenant's requests bucket, 7 tenant's tokens bucket (its batch_tokens bucket for a batch line),
--       8 tenant's unfinished jobs, 9 idempotency key, 10 the partition's ring flag of the tokenizers
--       (shared/ring.py)
-- ARGV: 1 ttl (s), 2 now (unix s), 3 owner ('' no tenant: KEYS 5-8 unused, the job key stands in), 4 tokens to reserve,
--       5 most jobs waiting in the partition (0 no cap), 6 idempotency ttl (0 no key), 7 request digest,
--       8 the jobs stream's approximate cap, 9 job-hash key prefix, 10 job id, 11 request JSON,
--       12 budget: 'interactive' (rpm and tpm) or 'batch' (no rpm; tokens from KEYS[7] at the tenant's
--       batch_tpm, a line costlier than a whole minute's waits for a full bucket; recorded as the job's
--       `budget`, so finish.lua refunds to that bucket), 13 the tokens the request takes (its every job's, for
--       the first job of a request of several; -1 for each later one: its request and tokens were taken with the
--       first, which also checked room for all of its jobs), 14 the request's jobs, 15.. record field/value pairs
-- A request of several jobs (OpenAI's `n`, a list of prompts) is one request of the tenant's rpm, and its jobs'
-- tokens are reserved at once by its first job; each job still records its own reservation (ARGV 4), so that
-- finish.lua's refunds, job by job, add up to what was taken.
-- A batch line is outside the key's unfinished jobs (max_queued: its batches never take its interactive
-- requests' room; the driver's window and max_open_batches bound them) and outside the queue's depth (the
-- submitted and dequeued counters: it waits behind every interactive job, at the lowest priority, so counting it
-- would refuse interactive requests that would not wait for it); its record says so (`counted` 0), which
-- start.lua and finish.lua read.
-- One key is not in KEYS: the job an idempotency key names (KEYS[9]'s value), checked for existence, so that a
-- key outliving its job admits the request anew. Its id is known only from that value: naming it up front
-- would cost every keyed submit a read first (one more round trip), and making ids follow from keys would
-- change which job a key outliving its job names. It is in the job's partition, so in KEYS[1]'s slot:
-- shared/names.py's idempotency_key and new_job_partition place both by the same owner and key.
-- Returns {1, ordinal, dequeued, rpm, requests left, requests reset ms, tpm, tokens left, tokens reset ms};
--   {2, job id} an idempotent replay, or this very call sent again; {-1} unknown or disabled tenant;
--   {-2, retry ms, rpm, reset ms} over
--   its requests per minute; {-3, retry ms, tpm, left, reset ms} over its tokens per minute; {-4, limit}
--   at its unfinished-jobs limit; {-5, depth} the service-wide queue is full; {-6} the idempotency key
--   was used with another body; {-7, tpm} the request alone needs more than the tenant's tokens per minute;
--   {-8, limit} the request alone has more jobs than the tenant's unfinished-jobs limit.
local job, jobs, submitted, dequeued_key, tenant = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local requests_bucket, tokens_bucket, active, idem = KEYS[6], KEYS[7], KEYS[8], KEYS[9]
local ttl, now, owner, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
local max_waiting, idem_ttl, digest, jobs_cap = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local job_prefix, job_id, request, budget = ARGV[9], ARGV[10], ARGV[11], ARGV[12]
local charge, request_jobs = tonumber(ARGV[13]), tonumber(ARGV[14])
local line, charged = budget == 'batch', charge < 0
-- the same call sent again (its reply was lost to a dropped connection) finds its job: enqueued and
-- charged once; the caller knows the id for its own
if redis.call('EXISTS', job) == 1 then return {2, job_id} end
if idem_ttl ~= '0' then
  local seen = redis.call('GET', idem)
  if seen then
    local sep = string.find(seen, ':', 1, true)
    local id, seen_digest = string.sub(seen, 1, sep - 1), string.sub(seen, sep + 1)
    if redis.call('EXISTS', job_prefix .. id) == 1 then
      if seen_digest ~= digest then return {-6} end
      return {2, id}
    end
  end
end
local function bucket(key, cap, take)
  if cap <= 0 then return true, -1, 0, 0 end
  local rate = cap / 60.0
  local st = redis.call('HMGET', key, 't', 'ts')
  local left = math.min(cap, (tonumber(st[1]) or cap) + math.max(0, now - (tonumber(st[2]) or now)) * rate)
  if left < take then return false, left, (cap - left) / rate, (take - left) / rate end
  return true, left - take, (cap - left + take) / rate, 0
end
local rpm, tpm, r_left, r_reset, t_left, t_reset, weight = 0, 0, -1, 0, -1, 0, '1'
if owner ~= '' then
  local t = redis.call('HMGET', tenant, 'disabled', 'rpm', 'tpm', 'max_queued', 'weight', 'batch_tpm')
  weight = t[5] or '1'
  if not t[1] or t[1] == '1' then return {-1} end
  rpm, tpm = tonumber(t[2]) or 0, tonumber(t[3]) or 0
  if budget == 'batch' then
    rpm, tpm = 0, tonumber(t[6]) or 0
    if tpm > 0 then cost, charge = math.min(cost, tpm), math.min(charge, tpm) end
  end
  local maxq = tonumber(t[4]) or 0
  if maxq > 0 and not line then
    if not charged and request_jobs > maxq then return {-8, maxq} end
    local room = charged and 1 or request_jobs
    if tonumber(redis.call('GET', active) or '0') + room > maxq then return {-4, maxq} end
  end
  if charged then
    rpm, tpm = 0, 0  -- taken with the request's first job
  else
    local ok, retry
    ok, r_left, r_reset, retry = bucket(requests_bucket, rpm, 1)
    if not ok then return {-2, math.ceil(retry * 1000), rpm, math.ceil(r_reset * 1000)} end
    if tpm > 0 and charge > tpm then return {-7, tpm} end
    ok, t_left, t_reset, retry = bucket(tokens_bucket, tpm, charge)
    if not ok then return {-3, math.ceil(retry * 1000), tpm, math.floor(t_left), math.ceil(t_reset * 1000)} end
  end
end
local dequeued = tonumber(redis.call('GET', dequeued_key) or '0')
if max_waiting ~= '0' then
  local depth = tonumber(redis.call('GET', submitted) or '0') - dequeued
  if depth >= tonumber(max_waiting) then return {-5, depth} end
end
if owner ~= '' then
  if rpm > 0 then
    redis.call('HSET', requests_bucket, 't', r_left, 'ts', now)
    redis.call('EXPIRE', requests_bucket, 120)
  end
  if tpm > 0 then
    redis.call('HSET', tokens_bucket, 't', t_left, 'ts', now)
    redis.call('EXPIRE', tokens_bucket, 120)
  end
  if not line then
    redis.call('INCR', active)
    redis.call('EXPIRE', active, ttl)
  end
end
if idem_ttl ~= '0' then redis.call('SET', idem, job_id .. ':' .. digest, 'EX', tonumber(idem_ttl)) end
local ordinal -- a batch line's: the interactive jobs submitted before it
if line then ordinal = tonumber(redis.call('GET', submitted) or '0') else ordinal = redis.call('INCR', submitted) end
for i = 15, #ARGV, 2 do redis.call('HSET', job, ARGV[i], ARGV[i + 1]) end
redis.call('HSET', job, 'ordinal', ordinal, 'owner', owner, 'reserved_tokens', cost, 'weight', weight)
if line then redis.call('HSET', job, 'budget', budget, 'counted', '0') end
redis.call('EXPIRE', job, ttl)
redis.call('XADD', jobs, 'MAXLEN', '~', jobs_cap, '*', 'job_id', job_id, 'request', request)
local channel = redis.call('GETDEL', KEYS[10]) -- a tokenizer sleeps: wake it
if channel then redis.call('PUBLISH', channel, KEYS[10]) end
return {1, ordinal, dequeued, rpm, math.floor(r_left), math.ceil(r_reset * 1000), tpm, math.floor(t_left),
        math.ceil(t_reset * 1000)}
