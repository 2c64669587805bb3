"""The job model: statuses, finish reasons, the record kept in Redis and its state transitions.

A job record is a Redis hash (`names.job_key`). Transitions that race (a cancel against a
worker starting the job, two workers finishing it) are Lua scripts, so each is atomic.
"""

from __future__ import annotations

import time
from enum import Enum
from typing import Any

from pydantic import BaseModel, Field


class JobStatus(str, Enum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


ACTIVE = frozenset({JobStatus.queued, JobStatus.running})
TERMINAL = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})


class FinishReason(str, Enum):
    stop = "stop"
    length = "length"
    cancelled = "cancelled"
    error = "error"


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class Job(BaseModel):
    """The job object clients see (poll, `done` event, submit and cancel responses)."""

    id: str
    object: str = "job"
    status: JobStatus
    model: str
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage
    error: str | None = None
    queue_position: int | None = None
    created_at: float
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    owner: str = Field("", exclude=True)  # the tenant that submitted it ('' when auth is off); never shown

    @classmethod
    def from_record(cls, rec: dict[str, str]) -> Job:
        def num(name: str) -> float | None:
            v = rec.get(name)
            return float(v) if v else None

        prompt = int(rec.get("prompt_tokens") or 0)
        completion = int(rec.get("completion_tokens") or 0)
        return cls(
            id=rec["id"],
            status=JobStatus(rec["status"]),
            model=rec.get("model", ""),
            text=rec.get("text", ""),
            finish_reason=FinishReason(rec["finish_reason"]) if rec.get("finish_reason") else None,
            usage=Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion),
            error=rec.get("error") or None,
            created_at=float(rec["created_at"]),
            started_at=num("started_at"),
            first_token_at=num("first_token_at"),
            finished_at=num("finished_at"),
            owner=rec.get("owner") or "",
        )

    @property
    def ended(self) -> bool:
        return self.status in TERMINAL


def new_record(job_id: str, model: str, request_json: str, background: bool) -> dict[str, Any]:
    return {
        "id": job_id,
        "status": JobStatus.queued.value,
        "model": model,
        "request": request_json,
        "created_at": repr(time.time()),
        "seq": 0,
        "background": int(background),
    }


# KEYS[1] job hash, KEYS[2] dequeued counter.  ARGV: now, worker id.
# Returns {code, seq, created_at}: code 1 started, 2 already running (a redelivery: resume),
# 0 ended or cancelled, -1 missing.
START_SCRIPT = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return {-1, 0, ''} end
local seq = tonumber(redis.call('HGET', KEYS[1], 'seq') or '0')
local created = redis.call('HGET', KEYS[1], 'created_at') or ''
if redis.call('HGET', KEYS[1], 'cancel_requested') == '1' then return {0, seq, created} end
if st == 'queued' then
  redis.call('HSET', KEYS[1], 'status', 'running', 'started_at', ARGV[1], 'worker', ARGV[2])
  redis.call('INCR', KEYS[2])
  return {1, seq, created}
end
if st == 'running' then
  redis.call('HSET', KEYS[1], 'worker', ARGV[2])
  return {2, seq, created}
end
return {0, seq, created}
"""

# KEYS[1] job hash, KEYS[2] event stream, KEYS[3] token list key, KEYS[4] dequeued counter, KEYS[5] text,
# KEYS[6] the ended stream.
# ARGV: status, finish_reason, error, now, ttl, channel, required current status ('' = any active),
#       job id, the ended stream's cap, the key prefix, then field/value pairs to set.
# Ends an active job exactly once: sets the terminal state, appends `done` to its event stream,
# publishes it, starts the retention clock and queues the after-job work; a tenant's job leaves its
# unfinished count and gives back the tokens it reserved and did not use. Returns the done event's
# seq, or 0 if the job had already ended (or was not in the required status), -1 if it does not exist.
FINISH_SCRIPT = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return -1 end
if st ~= 'queued' and st ~= 'running' then return 0 end
if ARGV[7] ~= '' and st ~= ARGV[7] then return 0 end
if st == 'queued' then redis.call('INCR', KEYS[4]) end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'finish_reason', ARGV[2], 'error', ARGV[3], 'finished_at', ARGV[4])
for i = 11, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
local seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
redis.call('XADD', KEYS[2], '0-' .. seq, 'type', 'done')
local ttl = tonumber(ARGV[5])
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
redis.call('EXPIRE', KEYS[3], ttl)
redis.call('EXPIRE', KEYS[5], ttl)
redis.call('PUBLISH', ARGV[6], cjson.encode({seq = seq, type = 'done'}))
redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[9], '*', 'job_id', ARGV[8])
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= '' then
  -- the tenant's keys, named as shared/names.py names them (tenant_active_key, tenant_bucket_key, tenant_key)
  local p = ARGV[10]
  redis.call('DECR', p .. ':active:' .. owner)
  local rec = redis.call('HMGET', KEYS[1], 'reserved_tokens', 'prompt_tokens', 'completion_tokens')
  local refund = (tonumber(rec[1]) or 0) - (tonumber(rec[2]) or 0) - (tonumber(rec[3]) or 0)
  local tpm = tonumber(redis.call('HGET', p .. ':tenant:' .. owner, 'tpm') or '0') or 0
  local b = p .. ':bucket:' .. owner .. ':tokens'
  local left = tonumber(redis.call('HGET', b, 't') or '')
  if refund > 0 and tpm > 0 and left then redis.call('HSET', b, 't', math.min(tpm, left + refund)) end
end
return seq
"""

# One engine step's output for many jobs, in one call (the output lane's per-step write).
# KEYS, 4 per job: job hash, event stream, token ids, text.  ARGV: ttl, now, then 9 per job:
#   flags (1: first write from this lane, so set the TTLs; 2: first token, so set first_token_at),
#   token-ids offset, packed ids ('' none), text offset, text chunk ('' none), seq, the message to
#   publish, token count, the job's channel.
# Offsets (SETRANGE, not APPEND) and explicit event ids make a retried step write nothing twice; an
# event id already present is skipped (pcall), not an error that would stop the other jobs' writes.
STEP_SCRIPT = """
local ttl, now = tonumber(ARGV[1]), ARGV[2]
local a = 3
for k = 1, #KEYS, 4 do
  local job, events, ids, text = KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3]
  local flags = tonumber(ARGV[a])
  local fresh = flags % 2 == 1
  if fresh then
    redis.call('EXPIRE', events, ttl)
    redis.call('EXPIRE', ids, ttl)
    redis.call('EXPIRE', text, ttl)
  end
  if ARGV[a + 2] ~= '' then
    if flags >= 2 then redis.call('HSET', job, 'first_token_at', now) end
    redis.call('SETRANGE', ids, ARGV[a + 1], ARGV[a + 2])
  end
  if ARGV[a + 4] ~= '' then
    redis.call('SETRANGE', text, ARGV[a + 3], ARGV[a + 4])
    redis.pcall('XADD', events, '0-' .. ARGV[a + 5], 'type', 'token', 'text', ARGV[a + 4])
    redis.call('PUBLISH', ARGV[a + 8], ARGV[a + 6])
    redis.call('HSET', job, 'seq', ARGV[a + 5], 'completion_tokens', ARGV[a + 7])
    if fresh then
      redis.call('EXPIRE', events, ttl)
      redis.call('EXPIRE', text, ttl)
    end
  elseif ARGV[a + 2] ~= '' then
    redis.call('HSET', job, 'completion_tokens', ARGV[a + 7])
  end
  a = a + 9
end
return #KEYS / 4
"""

# Admits and enqueues a job in one atomic step: an idempotent replay, the tenant's limits, the
# service-wide queue cap, then the record, its queue ordinal and the `jobs` entry.
# KEYS: 1 job hash, 2 jobs stream, 3 submitted counter, 4 dequeued counter, 5 tenant hash,
#       6 tenant's requests bucket, 7 tenant's tokens bucket, 8 tenant's unfinished jobs, 9 idempotency key.
# ARGV: 1 ttl, 2 now (s), 3 owner ('' : no tenant, 5-8 unused), 4 tokens to reserve, 5 most jobs waiting
#       service-wide (0: no cap), 6 idempotency ttl (0: no key), 7 request digest, 8 the jobs stream's
#       approximate MAXLEN, 9 job-hash key prefix, 10 job id, 11 request JSON, 12.. record field/value pairs.
# Returns {1, ordinal, dequeued, rpm, requests left, requests reset ms, tpm, tokens left, tokens reset ms};
#   {2, job id} an idempotent replay; {-1} unknown or disabled tenant; {-2, retry ms, rpm, reset ms} over
#   its requests per minute; {-3, retry ms, tpm, left, reset ms} over its tokens per minute; {-4, limit}
#   at its unfinished-jobs limit; {-5, depth} the service-wide queue is full; {-6} the idempotency key
#   was used with another body; {-7, tpm} the request alone needs more than the tenant's tokens per minute.
SUBMIT_SCRIPT = """
local now, owner, cost = tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4])
if ARGV[6] ~= '0' then
  local seen = redis.call('GET', KEYS[9])
  if seen then
    local sep = string.find(seen, ':', 1, true)
    local id, digest = string.sub(seen, 1, sep - 1), string.sub(seen, sep + 1)
    if redis.call('EXISTS', ARGV[9] .. id) == 1 then
      if digest ~= ARGV[7] then return {-6} end
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
local rpm, tpm, r_left, r_reset, t_left, t_reset = 0, 0, -1, 0, -1, 0
if owner ~= '' then
  local t = redis.call('HMGET', KEYS[5], 'disabled', 'rpm', 'tpm', 'max_queued')
  if not t[1] or t[1] == '1' then return {-1} end
  rpm, tpm = tonumber(t[2]) or 0, tonumber(t[3]) or 0
  local maxq = tonumber(t[4]) or 0
  if maxq > 0 and tonumber(redis.call('GET', KEYS[8]) or '0') >= maxq then return {-4, maxq} end
  local ok, retry
  ok, r_left, r_reset, retry = bucket(KEYS[6], rpm, 1)
  if not ok then return {-2, math.ceil(retry * 1000), rpm, math.ceil(r_reset * 1000)} end
  if tpm > 0 and cost > tpm then return {-7, tpm} end
  ok, t_left, t_reset, retry = bucket(KEYS[7], tpm, cost)
  if not ok then return {-3, math.ceil(retry * 1000), tpm, math.floor(t_left), math.ceil(t_reset * 1000)} end
end
local dequeued = tonumber(redis.call('GET', KEYS[4]) or '0')
if ARGV[5] ~= '0' then
  local depth = tonumber(redis.call('GET', KEYS[3]) or '0') - dequeued
  if depth >= tonumber(ARGV[5]) then return {-5, depth} end
end
local ttl = tonumber(ARGV[1])
if owner ~= '' then
  if rpm > 0 then redis.call('HSET', KEYS[6], 't', r_left, 'ts', now); redis.call('EXPIRE', KEYS[6], 120) end
  if tpm > 0 then redis.call('HSET', KEYS[7], 't', t_left, 'ts', now); redis.call('EXPIRE', KEYS[7], 120) end
  redis.call('INCR', KEYS[8])
  redis.call('EXPIRE', KEYS[8], ttl)
end
if ARGV[6] ~= '0' then redis.call('SET', KEYS[9], ARGV[10] .. ':' .. ARGV[7], 'EX', tonumber(ARGV[6])) end
local ordinal = redis.call('INCR', KEYS[3])
for i = 12, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('HSET', KEYS[1], 'ordinal', ordinal, 'owner', owner, 'reserved_tokens', cost)
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[8], '*', 'job_id', ARGV[10], 'request', ARGV[11])
return {1, ordinal, dequeued, rpm, math.floor(r_left), math.ceil(r_reset * 1000), tpm, math.floor(t_left),
        math.ceil(t_reset * 1000)}
"""

# KEYS[1] job hash, KEYS[2] control channel is ARGV[1]. Returns the status before the request.
REQUEST_CANCEL_SCRIPT = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return '' end
if st == 'running' then
  redis.call('HSET', KEYS[1], 'cancel_requested', '1')
  redis.call('PUBLISH', ARGV[1], cjson.encode({op = 'cancel', job_id = ARGV[2]}))
end
return st
"""
