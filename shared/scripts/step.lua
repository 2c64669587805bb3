-- step: one engine step's output for many jobs in one call (the output lane's per-step write).
-- KEYS, 5 per job: job hash, event stream, token ids, text, logprob entries
-- ARGV: 1 ttl (s), 2 now (unix s), 3 how to publish (PUBLISH, or SPUBLISH on a cluster), 4 the jobs'
--   partition's key prefix (one call per partition), 5 how many tenants are charged, then 3 per tenant:
--   its fair-queue name, the charge on its virtual counter, the tokens served to it; then 11 per job, in
--   the order of its keys:
--   flags     sum of FRESH (1: the lane's first write for the job: set the TTLs of its keys) and
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
-- A step may be sent twice (replayed after a reconnect). Offsets (SETRANGE, not APPEND) make a second
-- write of ids or text a no-op, and a chunk whose seq is not past the job's recorded seq (the id of its
-- event stream's last entry) is a replay: it is not appended, published or recorded again.
-- The charges (the output lane sums the step's new tokens per tenant: shared/fair_queue.py) go on the
-- tenants' counters in the fair queue, unless every chunk of the call was a replay.
-- Returns {chunks written, chunks skipped as replays}.
local ttl, now, publish, prefix, n_charged = tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local written, replayed = 0, 0
local a = 6 + 3 * n_charged
for k = 1, #KEYS, 5 do
  local job, events, ids_key, text_key, lp_key = KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4]
  local flags, ids_at, ids, text_at, chunk, seq, message, n_tokens, channel, lp_at, lp = unpack(ARGV, a, a + 10)
  flags = tonumber(flags)
  if ids ~= '' then
    if flags >= 2 then redis.call('HSET', job, 'first_token_at', now) end
    redis.call('SETRANGE', ids_key, ids_at, ids)
  end
  if chunk ~= '' or lp ~= '' then
    if chunk ~= '' then redis.call('SETRANGE', text_key, text_at, chunk) end
    if lp ~= '' then
      redis.call('SETRANGE', lp_key, lp_at, lp)
      if redis.call('TTL', lp_key) < 0 then redis.call('EXPIRE', lp_key, ttl) end
    end
    if tonumber(seq) <= tonumber(redis.call('HGET', job, 'seq') or '0') then
      replayed = replayed + 1
    elseif lp ~= '' then
      redis.call('XADD', events, '0-' .. seq, 'type', 'token', 'text', chunk, 'logprobs', lp)
      redis.call(publish, channel, message)
      redis.call('HSET', job, 'seq', seq, 'completion_tokens', n_tokens)
      written = written + 1
    else
      redis.call('XADD', events, '0-' .. seq, 'type', 'token', 'text', chunk)
      redis.call(publish, channel, message)
      redis.call('HSET', job, 'seq', seq, 'completion_tokens', n_tokens)
      written = written + 1
    end
  elseif ids ~= '' then
    redis.call('HSET', job, 'completion_tokens', n_tokens)
  end
  if flags % 2 == 1 then
    redis.call('EXPIRE', events, ttl)
    redis.call('EXPIRE', ids_key, ttl)
    redis.call('EXPIRE', text_key, ttl)
    redis.call('EXPIRE', lp_key, ttl)
  end
  a = a + 11
end
if written > 0 or replayed == 0 then
  for c = 6, 5 + 3 * n_charged, 3 do
    local tenant, cost, tokens = ARGV[c], ARGV[c + 1], ARGV[c + 2]
    redis.call('HINCRBYFLOAT', prefix .. ':fair:vtc', tenant, cost)
    redis.call('ZADD', prefix .. ':fair:tenants', 'XX', 'INCR', cost, tenant)
    redis.call('HINCRBY', prefix .. ':fair:served', tenant, tokens)
  end
end
return {written, replayed}
