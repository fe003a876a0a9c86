-- Charge fairness keys for the service a worker gave them (after fair_queue.lua): the shared VTC
-- counters, and the scores that order the keys.
-- An update sent again after a lost reply (same token) changes nothing (fq_once).
-- ARGV: the queue name (fair_queue.lua), worker id, the update's token, then per key: the key, the
-- weighted tokens to add. Returns the keys charged.
local p = ARGV[1]
if not fq_once(p, 'charge', ARGV[2], ARGV[3]) then
  return 0
end
local tiers = redis.call('ZRANGE', fq(p, 'tiers'), 0, -1)
local n = 0
for i = 4, #ARGV, 2 do
  local key = ARGV[i]
  local counter = redis.call('HINCRBYFLOAT', fq(p, 'counter'), key, ARGV[i + 1])
  redis.call('ZADD', fq(p, 'backlogged'), 'XX', counter, key)
  for t = 1, #tiers do
    redis.call('ZADD', fq(p, 'ready', tiers[t]), 'XX', counter, key)
  end
  n = n + 1
end
return n
