-- take_request: one request from a tenant's requests-per-minute bucket, for a call that is no job (a tokenize
-- call, a token count): it spends the key's rpm as a submit does (submit.lua's bucket), so a key cannot flood the
-- tokenizer pool every tenant shares with calls its limit would refuse as jobs.
-- KEYS: 1 tenant hash, 2 the tenant's requests bucket
-- ARGV: 1 now (unix s)
-- Returns {1, rpm, requests left, reset ms} taken (rpm 0: no limit, nothing written); {-1} unknown or disabled
--   tenant; {-2, retry ms, rpm, reset ms} over its requests per minute (submit.lua's codes and shapes).
local tenant, bucket, now = KEYS[1], KEYS[2], tonumber(ARGV[1])
local t = redis.call('HMGET', tenant, 'disabled', 'rpm')
if not t[1] or t[1] == '1' then return {-1} end
local cap = tonumber(t[2]) or 0
if cap <= 0 then return {1, 0, -1, 0} end
local rate = cap / 60.0
local st = redis.call('HMGET', bucket, 't', 'ts')
local left = math.min(cap, (tonumber(st[1]) or cap) + math.max(0, now - (tonumber(st[2]) or now)) * rate)
if left < 1 then return {-2, math.ceil((1 - left) / rate * 1000), cap, math.ceil((cap - left) / rate * 1000)} end
redis.call('HSET', bucket, 't', left - 1, 'ts', now)
redis.call('EXPIRE', bucket, 120)
return {1, cap, math.floor(left - 1), math.ceil((cap - left + 1) / rate * 1000)}
