-- Take up to n requests for a worker, in its model's fair order (after fair_queue.lua).
-- ARGV: the queue name (fair_queue.lua), worker id, n, policy ("vtc" or "fcfs"), optionally a tier:
-- only requests of a higher tier are taken then (a worker whose rows are full preempts for them; a
-- batch request never is; '' for none), optionally batch_extra: up to that many batch requests more
-- once the n are taken (a worker prefetches batch work deeper than interactive). Returns the taken
-- records (JSON), in order, each followed by its take token: a new one for every take, which the
-- worker's writes and ends of the request carry (fq_owns). Each is held by the worker
-- (taken:{worker}, and held unless it is a batch request) until its first event or hand-back. A
-- worker reclaimed while it was silent (a pause longer than its heartbeat TTL) takes nothing until
-- it has learned so and registered afresh (inference.worker.recovery): everything it held before is
-- stale then, and nothing it takes afterwards is. Returns the status "RECLAIMED" then.
local p, worker, n, policy = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local above = tonumber(ARGV[5])
local batch_extra = tonumber(ARGV[6]) or 0
if redis.call('EXISTS', fq(p, 'reclaimed', worker)) == 1 then
  return redis.status_reply('RECLAIMED')
end
local out = {}
local function take_one(prio, key)
  local id = redis.call('ZRANGE', fq(p, 'q', prio, key), 0, 0)[1]
  local rec = fq_remove_waiting(p, id)
  local raw = cjson.encode(rec)
  local token = tostring(redis.call('INCR', fq(p, 'takes')))
  redis.call('HSET', fq(p, 'taken', worker), id, raw)
  redis.call('HSET', fq(p, 'take'), id, token)
  if not rec.batch then  -- a batch request never counts in gate 1
    redis.call('HINCRBY', fq(p, 'held'), worker, 1)
  end
  out[#out + 1] = raw
  out[#out + 1] = token
end
for _ = 1, n do
  local prio, key = fq_next_key(p, policy)
  if not key or (above and (prio == FQ_BATCH or tonumber(prio) <= above)) then
    break
  end
  take_one(prio, key)
end
-- Batch work sorts after every interactive request: the extra ones are the order's next ones
-- once no interactive request waits.
for _ = 1, batch_extra do
  local prio, key = fq_next_key(p, policy)
  if not key or prio ~= FQ_BATCH then
    break
  end
  take_one(prio, key)
end
return out
