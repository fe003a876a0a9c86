-- Charge fairness keys for the service a worker gave them (after fair_queue.lua): the shared VTC
-- counters, and the scores that order the keys.
-- ARGV: prefix, then per key: the key, the weighted tokens to add. Returns the keys charged.
local p = ARGV[1]
local tiers = redis.call('ZRANGE', fq(p, 'tiers'), 0, -1)
local n = 0
for i = 2, #ARGV, 2 do
  local key = ARGV[i]
  local counter = redis.call('HINCRBYFLOAT', fq(p, 'counter'), key, ARGV[i + 1])
  redis.call('ZADD', fq(p, 'backlogged'), 'XX', counter, key)
  for t = 1, #tiers do
    redis.call('ZADD', fq(p, 'ready', tiers[t]), 'XX', counter, key)
  end
  n = n + 1
end
return n
