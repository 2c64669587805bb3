-- fair_pop: the next jobs for an inference worker, fairest first: from the backlogged tenant with the
-- smallest virtual counter, that tenant's job of lowest priority, then earliest arrival. Each job taken
-- moves onto the `tokenized` stream and is read from it by this consumer in the same step, so it is
-- pending there (redelivered if the worker dies) exactly like any entry. Taking a job charges its tenant
-- its prompt tokens over its weight; step.lua charges the tokens it generates (2 each, over its weight).
-- KEYS: 1 backlogged tenants (zset), 2 virtual counters (hash), 3 payloads (hash), 4 doorbell (list),
--       5 the `tokenized` stream, 6 served tokens per tenant (zset: tenant -> tokens, and '~' their sum),
--       7 the waiting jobs, 8 the same by submit time, 9 each waiting job's place (fair_push.lua names their members and values), 10 the ring flag of
--       the model's inference workers (shared/ring.py)
-- ARGV: 1 the inference group, 2 consumer, 3 how many jobs at most, 4 the stream's approximate cap,
--       5.. pairs of a tenant and a priority: that tenant is passed over unless its next job's priority is
--       lower (a worker with every slot taken asks only for a job its engine makes room for: of a tenant
--       with none there, or better than the worst its tenant has there)
-- Returns the stream read's reply (XREADGROUP's: entries not yet delivered, up to the count, this
-- call's and any added otherwise, such as a redelivered entry split in one per job).
local backlog, counters, payloads, bell, stream, served = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local queue, ages, places, flag = KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local group, consumer, count, cap = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local PRIORITY_BASE = 1000 -- fair_push.lua's
local function ring(flag) -- a consumer of this partition sleeps: wake it (shared/ring.py)
  local channel = redis.call('GETDEL', flag)
  if channel then redis.call('PUBLISH', channel, flag) end
end
local below, n_skip = {}, 0
for i = 5, #ARGV, 2 do below[ARGV[i]] = tonumber(ARGV[i + 1]); n_skip = n_skip + 1 end
local function head(t) -- the tenant's next job's member ('<tenant>:<order>:<job id>'), or nil
  return redis.call('ZRANGEBYLEX', queue, '[' .. t .. ':', '(' .. t .. ';', 'LIMIT', 0, 1)[1]
end
local function wanted(t)
  if not below[t] then return true end
  local member = head(t)
  return member ~= nil and tonumber(string.sub(member, #t + 2, #t + 5), 16) - PRIORITY_BASE < below[t]
end
local taken = 0
while taken < count do
  local tenant = nil
  for _, t in ipairs(redis.call('ZRANGE', backlog, 0, n_skip)) do -- the first n_skip + 1: one is not skipped
    if wanted(t) then tenant = t; break end
  end
  if not tenant then break end
  local member = head(tenant)
  if member then
    local job_id = string.sub(member, #tenant + 18)
    redis.call('ZREM', queue, member)
    local place = redis.call('HGET', places, job_id) or ''
    redis.call('HDEL', places, job_id)
    local _, _, created, n, weight = string.find(place, '^%x+:(%d+):(%d+):(.*)$')
    if created then redis.call('ZREM', ages, tenant .. ':' .. created .. ':' .. job_id) end
    local payload = redis.call('HGET', payloads, job_id)
    redis.call('HDEL', payloads, job_id)
    if payload then
      redis.call('XADD', stream, 'MAXLEN', '~', cap, '*', 'batch', payload, 'jobs', 1)
      n = tonumber(n) or 0
      local cost = n / (tonumber(weight) or 1)
      redis.call('ZINCRBY', backlog, cost, tenant)
      redis.call('HINCRBYFLOAT', counters, tenant, cost)
      redis.call('ZINCRBY', served, n, tenant)
      redis.call('ZINCRBY', served, n, '~')
      taken = taken + 1
    end
  end
  if not head(tenant) then redis.call('ZREM', backlog, tenant) end
end
if taken > 0 and redis.call('ZCARD', backlog) > 0 then
  redis.call('LPUSH', bell, 1) -- more waits: wake another worker
  redis.call('LTRIM', bell, 0, 0)
  ring(flag)
end
return redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', math.max(count, 1), 'STREAMS', stream, '>')
