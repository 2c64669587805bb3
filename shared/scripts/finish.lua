-- finish: end an active job exactly once.
-- KEYS: 1 job hash, 2 event stream, 3 token ids, 4 dequeued counter, 5 text, 6 the ended stream
-- ARGV: 1 status, 2 finish reason, 3 error, 4 now (unix s), 5 ttl (s), 6 the job's channel,
--       7 required current status ('' any active one), 8 job id, 9 the ended stream's approximate cap,
--       10 the job's partition prefix, 11 how to publish (PUBLISH, or SPUBLISH on a cluster),
--       12 the ending worker ('' any: the API, a failure outside a worker's run): a worker ends only a job
--       whose record names it (start.lua's `worker`), 13.. field/value pairs to set on the record
-- A job still waiting in the fair queue (shared/fair_queue.py) leaves it. Sets the terminal state, appends `done` to the event stream and publishes it, starts the retention
-- clock of the job's keys and appends the job to the ended stream (the after-job work). A tenant's job
-- leaves its unfinished count and gives back the tokens it reserved and did not use (to the bucket it
-- reserved from: `tokens`, or `batch_tokens` for a batch line, whose record says budget=batch); the tenant's keys
-- are named from the partition prefix (a tenant's jobs live in its partition) as shared/names.py names them (tenant_active_key, tenant_bucket_key, tenant_key).
-- A job that does not exist, or is another worker's, has nothing written.
-- Returns the done event's seq; 0 if the job had already ended (or was not in the required status);
--   -1 if it does not exist; -2 if the ending worker is not the job's.
local job, events, ids, dequeued, text, ended = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local status, reason, err, now, ttl, channel = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), ARGV[6]
local required, job_id, ended_cap, prefix, publish = ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11]
local worker = ARGV[12]
local rec = redis.call('HMGET', job, 'status', 'worker')
local st = rec[1]
if not st then return -1 end
-- before the status: a worker cut off while another took its job over hears so even once that one ended it
if worker ~= '' and (rec[2] or '') ~= worker then return -2 end
if st ~= 'queued' and st ~= 'running' then return 0 end
if required ~= '' and st ~= required then return 0 end
if st == 'queued' then
  redis.call('INCR', dequeued)
  if redis.call('HDEL', prefix .. ':fair:payload', job_id) == 1 then -- waiting in the fair queue: leave it
    local tenant = redis.call('HGET', job, 'fair_queued')
    redis.call('ZREM', prefix .. ':fair:q:' .. tenant, job_id)
    redis.call('ZREM', prefix .. ':fair:age:' .. tenant, job_id)
    if redis.call('ZCARD', prefix .. ':fair:q:' .. tenant) == 0 then redis.call('ZREM', prefix .. ':fair:tenants', tenant) end
  end
end
redis.call('HSET', job, 'status', status, 'finish_reason', reason, 'error', err, 'finished_at', now)
for i = 13, #ARGV, 2 do redis.call('HSET', job, ARGV[i], ARGV[i + 1]) end
local seq = redis.call('HINCRBY', job, 'seq', 1)
redis.call('XADD', events, '0-' .. seq, 'type', 'done')
redis.call('EXPIRE', job, ttl)
redis.call('EXPIRE', events, ttl)
redis.call('EXPIRE', ids, ttl)
redis.call('EXPIRE', text, ttl)
redis.call(publish, channel, cjson.encode({seq = seq, type = 'done'}))
redis.call('XADD', ended, 'MAXLEN', '~', ended_cap, '*', 'job_id', job_id)
local owner = redis.call('HGET', job, 'owner')
if owner and owner ~= '' then
  redis.call('DECR', prefix .. ':active:' .. owner)
  local rec = redis.call('HMGET', job, 'reserved_tokens', 'prompt_tokens', 'completion_tokens', 'budget')
  local refund = (tonumber(rec[1]) or 0) - (tonumber(rec[2]) or 0) - (tonumber(rec[3]) or 0)
  local cap, kind = 'tpm', 'tokens'
  if rec[4] == 'batch' then cap, kind = 'batch_tpm', 'batch_tokens' end -- a batch line's own bucket (submit.lua)
  local tpm = tonumber(redis.call('HGET', prefix .. ':tenant:' .. owner, cap) or '0') or 0
  local bucket = prefix .. ':bucket:' .. owner .. ':' .. kind
  local left = tonumber(redis.call('HGET', bucket, 't') or '')
  if refund > 0 and tpm > 0 and left then redis.call('HSET', bucket, 't', math.min(tpm, left + refund)) end
end
return seq
