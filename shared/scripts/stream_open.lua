-- stream_open: take one of a tenant's event-stream slots if one is free.
-- KEYS: 1 the tenant's open streams (sorted set, scored by when each lease runs out)
-- ARGV: 1 stream id, 2 now (unix s), 3 lease (s), 4 limit (0 none)
-- Expired leases are dropped first. Returns 1, or 0 when the tenant is at its limit.
local streams = KEYS[1]
local stream_id, now, lease, limit = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', streams, '-inf', now)
if limit > 0 and redis.call('ZCARD', streams) >= limit then return 0 end
redis.call('ZADD', streams, now + lease, stream_id)
redis.call('EXPIRE', streams, lease)
return 1
