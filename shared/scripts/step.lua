-- step: one engine step's output for many jobs in one call (the output lane's per-step write).
-- KEYS: 1-3 the jobs' partition's fair-queue virtual counters (hash), backlogged tenants (zset) and tokens
--   served (zset: tenant -> tokens, and '~' their sum) (one call per partition), then 5 per job: job hash, event stream, token ids, text, logprob entries
-- ARGV: 1 ttl (s), 2 now (unix s), 3 how to publish (PUBLISH, or SPUBLISH on a cluster), then 15 per job, in the
--   order of its keys:
--   flags     sum of FRESH (1: the lane's first write for the job: set the TTLs of its keys and its record) and
--             FIRST_TOKEN (2: the job's first token: set first_token_at); shared/job_ops.py names them
--   ids_at    byte offset of `ids` in the token ids
--   ids       packed int32 little-endian token ids ('' none)
--   text_at   byte offset of `chunk` in the text
--   chunk     the text chunk ('' none)
--   seq       the chunk's event id (0-<seq>)
--   message   what to publish on the job's channel
--   n_tokens  completion tokens so far
--   channel   the job's pub/sub channel
--   lp_at     byte offset of `lp` in the logprob entries
--   lp        the chunk's tokens' logprob entries, lines of JSON ('' none: the job did not ask); they go
--             into the chunk's event too, which is written for them even when its text is empty
--   worker    the writing worker: the job's part is written only while the job is running and its
--             record names this worker (start.lua's `worker`)
--   tenant    the fair-queue tenant its new tokens are charged to ('' none)
--   cost      the charge on the tenant's virtual counter
--   tokens    the tokens served to the tenant
-- A running job's keys count JOB_TTL_S afresh from its first write, and again whenever half of it has gone (a job
-- that runs for longer than its TTL keeps its record and its stream until it ends: finish.lua sets the last TTL).
-- A job refused (its record gone, another worker's now, or not running) has nothing written: no key of
-- it is touched (a record lost to a failover is not brought back as a half record), and a worker cut
-- off past the claim deadline neither duplicates output nor writes into a job another worker took.
-- A step may be sent twice (replayed after a reconnect): a chunk whose seq is not past the job's
-- recorded seq (the id of its event stream's last entry), or ids without a chunk whose n_tokens is not
-- past its recorded completion_tokens, is a replay, and nothing of the job's part is written again.
-- A part that does not start where the job's text or ids end (a failover promoted a replica that lacked earlier
-- steps of this worker, or an earlier step's write failed) is a gap: nothing of it is written (SETRANGE past the end
-- would fill the hole with NUL bytes), and the lane fails the job.
-- A job's charge (its new tokens: shared/fair_queue.py) goes on its tenant's counters in the fair queue when its
-- part is written, not when it is refused or replayed: a call sent again after part of it ran charges no job twice.
-- Returns a code per job, in the order of the call's jobs: 1 written, 2 a replay, 0 not running (ended),
--   -1 no such job, -2 not this worker's (another's, or none's: queued again after a failover lost its start),
--   -3 a gap: the record lacks earlier steps of this job, or a key of the job is not of its type (nothing more of
--   its part is written; the lane fails it, alone).
local vtc, backlog, served = KEYS[1], KEYS[2], KEYS[3]
local ttl, now, publish = tonumber(ARGV[1]), ARGV[2], ARGV[3]
local codes, charged, costs, tokens = {}, {}, {}, {}
local a = 4
-- One job's part: its code. A key of the job that is not of its type (damaged by hand) raises WRONGTYPE, and
-- the loop below counts the job's part a gap: the job fails alone, the others' parts are written.
local function part(job, events, ids_key, text_key, lp_key, flags, ids_at, ids, text_at, chunk, seq, message, n_tokens,
                    channel, lp_at, lp, worker)
  flags = tonumber(flags)
  local rec = redis.call('HMGET', job, 'status', 'worker', 'seq', 'completion_tokens')
  local has_chunk = chunk ~= '' or lp ~= ''
  local code = 1
  if not rec[1] then
    code = -1
  elseif (rec[2] or '') ~= worker then -- before the status: a job another worker took over and ended is not this one's
    code = -2
  elseif rec[1] ~= 'running' then
    code = 0
  elseif has_chunk and tonumber(seq) <= tonumber(rec[3] or '0') then
    code = 2
  elseif not has_chunk and ids ~= '' and tonumber(n_tokens) <= tonumber(rec[4] or '0') then
    code = 2
  elseif (ids ~= '' and tonumber(ids_at) ~= redis.call('STRLEN', ids_key))
      or (chunk ~= '' and tonumber(text_at) ~= redis.call('STRLEN', text_key)) then
    code = -3
  end
  if code == 1 then
    if ids ~= '' then
      if flags >= 2 then redis.call('HSET', job, 'first_token_at', now) end
      redis.call('SETRANGE', ids_key, ids_at, ids)
    end
    if has_chunk then
      if chunk ~= '' then redis.call('SETRANGE', text_key, text_at, chunk) end
      if lp ~= '' then
        redis.call('SETRANGE', lp_key, lp_at, lp)
        if redis.call('TTL', lp_key) < 0 then redis.call('EXPIRE', lp_key, ttl) end
        redis.call('XADD', events, '0-' .. seq, 'type', 'token', 'text', chunk, 'logprobs', lp)
      else
        redis.call('XADD', events, '0-' .. seq, 'type', 'token', 'text', chunk)
      end
      redis.call(publish, channel, message)
      redis.call('HSET', job, 'seq', seq, 'completion_tokens', n_tokens)
    elseif ids ~= '' then
      redis.call('HSET', job, 'completion_tokens', n_tokens)
    end
    if flags % 2 == 1 or redis.call('TTL', job) * 2 < ttl then -- fresh, or half its TTL gone while it runs
      redis.call('EXPIRE', job, ttl)
      redis.call('EXPIRE', events, ttl)
      redis.call('EXPIRE', ids_key, ttl)
      redis.call('EXPIRE', text_key, ttl)
      redis.call('EXPIRE', lp_key, ttl)
    end
  end
  return code
end

for k = 4, #KEYS, 5 do
  local ok, code = pcall(part, KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4], unpack(ARGV, a, a + 11))
  if not ok then
    -- any other error (a refusal: OOM, NOREPLICAS) ends the call as it would have: its reply keeps its code
    if not string.find(tostring(code), 'WRONGTYPE', 1, true) then return redis.error_reply(tostring(code)) end
    code = -3
  end
  local tenant = ARGV[a + 12]
  if code == 1 and tenant ~= '' then
    if not costs[tenant] then
      charged[#charged + 1], costs[tenant], tokens[tenant] = tenant, 0, 0
    end
    costs[tenant] = costs[tenant] + tonumber(ARGV[a + 13])
    tokens[tenant] = tokens[tenant] + tonumber(ARGV[a + 14])
  end
  codes[#codes + 1] = code
  a = a + 15
end
local all = 0
for _, tenant in ipairs(charged) do -- per tenant, in the order of its first job
  redis.call('HINCRBYFLOAT', vtc, tenant, costs[tenant])
  redis.call('ZADD', backlog, 'XX', 'INCR', costs[tenant], tenant)
  redis.call('ZINCRBY', served, tokens[tenant], tenant)
  all = all + tokens[tenant]
end
if all > 0 then redis.call('ZINCRBY', served, all, '~') end
return codes
