-- finish: end an active job exactly once.
-- KEYS: 1 job hash, 2 event stream, 3 token ids, 4 dequeued counter, 5 text, 6 the ended stream, 7-11 the
--       partition's fair queue of the job's model: backlogged tenants, payloads, waiting jobs, the same by
--       submit time, each waiting job's place (fair_push.lua), 12-15 the owner's unfinished jobs, tenant hash, `tokens` and
--       `batch_tokens` buckets (for a job without an owner, its own key stands in for each), 16 the partition's
--       ring flag of the after-job drain (shared/ring.py), 17 the partition's usage of the day the job ends, 18 19
--       the job's logprob entries and prompt logprobs (each kept as long as its record)
-- ARGV: 1 status, 2 finish reason, 3 error, 4 now (unix s), 5 ttl (s), 6 the job's channel,
--       7 required current status ('' any active one), 8 job id, 9 the ended stream's oldest id kept (MINID ~),
--       10 the owner KEYS 12-15 are named for ('' none), 11 how to publish (PUBLISH, or SPUBLISH on a cluster),
--       12 the ending worker ('' any: the API, a failure outside a worker's run): a worker ends only a job
--       whose record names it (start.lua's `worker`), 13 the model queue KEYS 7-11 are named for (the record's
--       `base_model`, '' the default model), 14 15 the chunk seq and the completion tokens the record must
--       show already (0 0: any), 16 the usage hash's ttl (s), 17.. field/value pairs to set on the record
-- A job's tokens go onto its day's usage (per model) with its end, once (its record's `accounted` marks it: a job
-- ended before this script counted, by shared/scripts/account.lua, is counted there, once too).
-- A job still waiting in the fair queue (shared/fair_queue.py) leaves it. Sets the terminal state, appends
-- `done` to the event stream and publishes it, starts the retention clock of the job's keys and appends the
-- job to the ended stream (the after-job work). A tenant's job leaves its unfinished count and gives back the
-- tokens it reserved and did not use (to the bucket it reserved from: `tokens`, or `batch_tokens` for a batch
-- line, whose record says budget=batch), or is charged those it used past its reservation. The owner's keys come from the caller, who reads the record's owner
-- first (or knows it): a record that names another owner has nothing written, and the caller reads it again.
-- A job that does not exist, or is another worker's, has nothing written. A worker's finish names what its
-- job's last step wrote (ARGV 14, 15): until the record shows it, the job is not ended (that step was lost in a
-- failover, or comes after this call: a cluster client resends a pipeline's failed commands one by one), so
-- the step, sent again, is not refused as one of an ended job and its chunk lost.
-- Returns the done event's seq; 0 if the job had already ended (or was not in the required status);
--   -1 if it does not exist (or its record is not a hash); -2 if the ending worker is not the job's; -3 if the record's owner or model is not
--   the one the keys were named for (nothing written: name them again); -4 if the record does not show the
--   step ARGV 14, 15 name yet (nothing written: send that step, then this call, again).
local job, events, ids, dequeued, text, ended = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local status, reason, err, now, ttl, channel = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]), ARGV[6]
local backlog, payloads, queue, ages, places = KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11]
local active, tenant_key, tokens_bucket, batch_bucket = KEYS[12], KEYS[13], KEYS[14], KEYS[15]
local required, job_id, ended_min, named_owner, publish = ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11]
local worker, named_model = ARGV[12], ARGV[13]
-- (a record damaged by hand into a key of another type is no job: nothing is written, its caller goes on)
local rec = redis.pcall('HMGET', job, 'status', 'worker', 'owner', 'base_model', 'seq', 'completion_tokens',
                        'counted')
if rec.err then return -1 end
local st = rec[1]
if not st then return -1 end
-- before the status: a worker cut off while another took its job over hears so even once that one ended it
if worker ~= '' and (rec[2] or '') ~= worker then return -2 end
if st ~= 'queued' and st ~= 'running' then return 0 end
if required ~= '' and st ~= required then return 0 end
local owner = rec[3] or ''
if owner ~= named_owner or (rec[4] or '') ~= named_model then return -3 end
if tonumber(rec[5] or '0') < tonumber(ARGV[14]) or tonumber(rec[6] or '0') < tonumber(ARGV[15]) then return -4 end
local counted = rec[7] ~= '0' -- a batch line is in neither the depth nor the unfinished jobs (submit.lua)
if st == 'queued' then
  if counted then redis.call('INCR', dequeued) end
  if redis.call('HDEL', payloads, job_id) == 1 then -- waiting in the fair queue: leave it
    local tenant = redis.call('HGET', job, 'fair_queued') or ''
    local _, _, order, created = string.find(redis.call('HGET', places, job_id) or '', '^(%x+):(%d+):')
    redis.call('HDEL', places, job_id)
    if order then
      redis.call('ZREM', queue, tenant .. ':' .. order .. ':' .. job_id)
      redis.call('ZREM', ages, tenant .. ':' .. created .. ':' .. job_id)
    end
    local left = redis.call('ZRANGEBYLEX', queue, '[' .. tenant .. ':', '(' .. tenant .. ';', 'LIMIT', 0, 1)
    if not left[1] then redis.call('ZREM', backlog, tenant) end
  end
end
redis.call('HSET', job, 'status', status, 'finish_reason', reason, 'error', err, 'finished_at', now)
for i = 17, #ARGV, 2 do redis.call('HSET', job, ARGV[i], ARGV[i + 1]) end
if redis.call('HSETNX', job, 'accounted', '1') == 1 then
  local use = redis.call('HMGET', job, 'model', 'prompt_tokens', 'completion_tokens')
  local model, usage = use[1] or '', KEYS[17]
  redis.call('HINCRBY', usage, model .. ':prompt_tokens', tonumber(use[2] or '0') or 0)
  redis.call('HINCRBY', usage, model .. ':completion_tokens', tonumber(use[3] or '0') or 0)
  redis.call('HINCRBY', usage, model .. ':jobs', 1)
  redis.call('EXPIRE', usage, ARGV[16])
end
local seq = redis.call('HINCRBY', job, 'seq', 1)
redis.pcall('XADD', events, '0-' .. seq, 'type', 'done') -- (an event stream damaged by hand ends the job all the same)
redis.call('EXPIRE', job, ttl)
redis.call('EXPIRE', events, ttl)
redis.call('EXPIRE', ids, ttl)
redis.call('EXPIRE', text, ttl)
redis.call('EXPIRE', KEYS[18], ttl)
redis.call('EXPIRE', KEYS[19], ttl)
redis.call(publish, channel, cjson.encode({seq = seq, type = 'done'}))
redis.call('XADD', ended, 'MINID', '~', ended_min, '*', 'job_id', job_id)
local drain = redis.call('GETDEL', KEYS[16]) -- an after-job drain sleeps: wake it
if drain then redis.call('PUBLISH', drain, KEYS[16]) end
if owner ~= '' then
  if counted then redis.call('DECR', active) end
  local rec = redis.call('HMGET', job, 'reserved_tokens', 'prompt_tokens', 'completion_tokens', 'budget')
  local refund = (tonumber(rec[1]) or 0) - (tonumber(rec[2]) or 0) - (tonumber(rec[3]) or 0)
  local cap, bucket = 'tpm', tokens_bucket
  if rec[4] == 'batch' then cap, bucket = 'batch_tpm', batch_bucket end -- a batch line's own bucket (submit.lua)
  local tpm = tonumber(redis.call('HGET', tenant_key, cap) or '0') or 0
  local left = tonumber(redis.call('HGET', bucket, 't') or '')
  if refund > 0 and tpm > 0 and left then redis.call('HSET', bucket, 't', math.min(tpm, left + refund)) end
  if refund < 0 and tpm > 0 then -- it used more than it reserved (a prompt denser in tokens than estimated): the
    -- rest is charged too, the bucket down to -tpm at most (an expired bucket was full); the next requests wait
    local at = tonumber(redis.call('HGET', bucket, 'ts') or '') or tonumber(now)
    redis.call('HSET', bucket, 't', math.max(-tpm, (left or tpm) + refund), 'ts', at)
    redis.call('EXPIRE', bucket, 120)
  end
end
return seq
