-- fair_pop: the next jobs for an inference worker, fairest first: from the backlogged tenant with the
-- smallest virtual counter, that tenant's job of lowest priority, then earliest arrival. Each job taken
-- moves onto the `tokenized` stream and is read from it by this consumer in the same step, so it is
-- pending there (redelivered if the worker dies) exactly like any entry. Taking a job charges its tenant
-- its prompt tokens over its weight; step.lua charges the tokens it generates (2 each, over its weight).
-- KEYS: 1 backlogged tenants (zset), 2 virtual counters (hash), 3 payloads (hash), 4 doorbell (list),
--       5 the `tokenized` stream, 6 served tokens per tenant (hash)
-- ARGV: 1 the inference group, 2 consumer, 3 how many jobs at most, 4 the partition's key prefix,
--       5 the stream's approximate cap, 6.. pairs of a tenant and a priority: that tenant is passed over
--       unless its next job's priority is lower (a worker with every slot taken asks only for a job its
--       engine makes room for: of a tenant with none there, or better than the worst its tenant has there)
-- Returns the stream read's reply (XREADGROUP's: entries not yet delivered, up to the count, this
-- call's and any added otherwise, such as a redelivered entry split in one per job).
local backlog, counters, payloads, bell, stream, served = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local group, consumer, count, prefix, cap = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local SPAN = 2199023255552 -- fair_push.lua's: a queued job's score is priority * SPAN + arrival
local below, n_skip = {}, 0
for i = 6, #ARGV, 2 do below[ARGV[i]] = tonumber(ARGV[i + 1]); n_skip = n_skip + 1 end
local function wanted(t)
  if not below[t] then return true end
  local head = redis.call('ZRANGE', prefix .. ':fair:q:' .. t, 0, 0, 'WITHSCORES')
  return head[2] ~= nil and math.floor(tonumber(head[2]) / SPAN) < below[t]
end
local taken = 0
while taken < count do
  local tenant = nil
  for _, t in ipairs(redis.call('ZRANGE', backlog, 0, n_skip)) do -- the first n_skip + 1: one is not skipped
    if wanted(t) then tenant = t; break end
  end
  if not tenant then break end
  local queue = prefix .. ':fair:q:' .. tenant
  local head = redis.call('ZPOPMIN', queue)
  if head[1] then
    local job_id = head[1]
    local payload = redis.call('HGET', payloads, job_id)
    redis.call('HDEL', payloads, job_id)
    redis.call('ZREM', prefix .. ':fair:age:' .. tenant, job_id)
    if payload then
      redis.call('XADD', stream, 'MAXLEN', '~', cap, '*', 'batch', payload, 'jobs', 1)
      local rec = redis.call('HMGET', prefix .. ':job:' .. job_id, 'prompt_tokens', 'weight')
      local n = tonumber(rec[1]) or 0
      local cost = n / (tonumber(rec[2]) or 1)
      redis.call('ZINCRBY', backlog, cost, tenant)
      redis.call('HINCRBYFLOAT', counters, tenant, cost)
      redis.call('HINCRBY', served, tenant, n)
      taken = taken + 1
    end
  end
  if redis.call('ZCARD', queue) == 0 then redis.call('ZREM', backlog, tenant) end
end
if taken > 0 and redis.call('ZCARD', backlog) > 0 then
  redis.call('LPUSH', bell, 1) -- more waits: wake another worker
  redis.call('LTRIM', bell, 0, 0)
end
return redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', math.max(count, 1), 'STREAMS', stream, '>')
