-- prune_consumers: remove a stream group's consumers that hold nothing and have not read for long: workers gone
-- (each process reads as a consumer of its own name, so every restart and scale-down leaves one behind).
-- KEYS: 1 the stream
-- ARGV: 1 the group, 2 the idle time (ms) past which a consumer with no pending entry is removed
-- A consumer that holds pending entries is never removed (they would become unclaimable); the check and the removal
-- are one step, so no read can come between them. A live worker reads every few seconds (its idle time stays
-- short); one removed all the same comes back with its next read.
-- Returns how many were removed (0 when the stream or the group does not exist).
local consumers = redis.pcall('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
if type(consumers) ~= 'table' or consumers.err then return 0 end
local removed, idle_ms = 0, tonumber(ARGV[2])
for _, c in ipairs(consumers) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if f['pending'] == 0 and f['idle'] >= idle_ms then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
    removed = removed + 1
  end
end
return removed
