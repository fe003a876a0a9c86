-- Take up to n requests for a worker, in the deployment's fair order (after fair_queue.lua).
-- ARGV: prefix, worker id, n, policy ("vtc" or "fcfs"), optionally a tier: only requests of a
-- higher tier are taken then (a worker whose rows are full preempts for them). Returns the taken
-- records (JSON), in order; each is held by the worker (taken:{worker}, held) until its first
-- event or hand-back.
local p, worker, n, policy = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local above = tonumber(ARGV[5])
local out = {}
for _ = 1, n do
  local prio, key = fq_next_key(p, policy)
  if not key or (above and tonumber(prio) <= above) then
    break
  end
  local id = redis.call('ZRANGE', fq(p, 'q', prio, key), 0, 0)[1]
  local rec = fq_remove_waiting(p, id)
  local raw = cjson.encode(rec)
  redis.call('HSET', fq(p, 'taken', worker), id, raw)
  redis.call('HINCRBY', fq(p, 'held'), worker, 1)
  out[#out + 1] = raw
end
return out
