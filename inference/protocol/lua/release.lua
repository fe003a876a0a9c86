-- Lower a worker's held count (after fair_queue.lua): n requests it took left its engine's
-- pending queue (admitted, or ended before). Unless the worker was reclaimed while it was silent:
-- its held count went with the reclaim (reclaim.lua), and what it still releases is stale. An
-- update sent again after a lost reply (same token) changes nothing (fq_once).
-- ARGV: the queue name (fair_queue.lua), worker id, n, the update's token. Returns 1, or 0 when
-- nothing changed (reclaimed).
local p, worker, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
if redis.call('EXISTS', fq(p, 'reclaimed', worker)) == 1 then
  return 0
end
if fq_once(p, 'release', worker, ARGV[4]) then
  redis.call('HINCRBY', fq(p, 'held'), worker, -n)
end
return 1
