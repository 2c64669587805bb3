-- batch_result: record one batch line's result exactly once (a batch's driver, workers/batch_driver.py).
-- KEYS: 1 the batch's record, 2 its `out` or `err` hash (index -> result line), 3 its `inflight` hash
-- ARGV: 1 the line's index, 2 its result line (JSON), 3 the counter it adds to: completed or failed
-- A result already recorded (a driver that died after this call and a new one doing it again) changes nothing;
-- nor does one for a batch whose record is gone (expired, or lost to a failover): nothing is written.
-- Returns 1 when recorded now, 0 when it already was, -1 when the batch's record is gone.
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local set = redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2])
-- the results never outlive the record (its end sets both TTLs; a record lost before then takes its results too)
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
redis.call('HDEL', KEYS[3], ARGV[1])
if set == 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
end
return set
