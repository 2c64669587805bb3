-- batch_cancel: ask a batch's driver to cancel it (the Batch API's cancel), in one step with the check of its status.
-- KEYS: 1 the batch's record
-- ARGV: 1 now (unix s)
-- A batch still validating or in progress becomes `cancelling` (its driver cancels its jobs and ends it); one that
-- has ended, or is cancelling already, is left as it is: a cancel that met the batch's end changes nothing.
-- Returns 1 when it is cancelling now, 0 otherwise (no such batch, or not running).
local st = redis.call('HGET', KEYS[1], 'status')
if st ~= 'validating' and st ~= 'in_progress' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
return 1
