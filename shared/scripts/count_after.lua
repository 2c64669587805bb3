-- count_after: count a stream's entries after an id, in pages, inside Redis (no entry crosses the wire).
-- KEYS: 1 stream
-- ARGV: 1 exclusive start ('(<id>'), 2 the most to count, 3 page size
-- Returns the entries counted (at most ARGV[2]).
local stream = KEYS[1]
local n, start, limit, page = 0, ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
while n < limit do
  local want = math.min(page, limit - n)
  local entries = redis.call('XRANGE', stream, start, '+', 'COUNT', want)
  n = n + #entries
  if #entries < want then break end
  start = '(' .. entries[#entries][1]
end
return n
