-- Put a request its worker preempted for a higher tier back in the queue (after fair_queue.lua).
-- It leaves the worker's running requests and waits again at its place (its arrival is kept, so
-- its fair place) with the message that lets the next worker, any worker, continue it (its resume
-- state). It stays in flight for its key (no VTC lift), keeps its concurrency leases, its events
-- stream and the seq of its next token event; gate 1 counts it again (waiting). Its record keeps
-- the usage it has so far, so that an end while it waits (withdrawn, expired) bills its tokens.
-- ARGV: the queue name (fair_queue.lua), worker id, request id, its take token, the new message
-- JSON, its usage so far (JSON), its new admission deadline (unix s, 0: none). Returns 1, or 0 when
-- the take is not the request's current one at this worker (it was reclaimed, or lost with Redis's
-- data, while it ran): nothing changes then.
local p, worker, id = ARGV[1], ARGV[2], ARGV[3]
if not fq_owns(p, id, ARGV[4]) then
  return 0
end
local owner = fq(p, 'running', worker)
local raw = redis.call('HGET', owner, id)
if not raw then
  owner = fq(p, 'taken', worker)
  raw = redis.call('HGET', owner, id)
end
if not raw then
  return 0
end
redis.call('HDEL', owner, id)
redis.call('HDEL', fq(p, 'take'), id)
local rec = cjson.decode(raw)
rec.body = ARGV[5]
rec.usage = cjson.decode(ARGV[6])
rec.deadline = tonumber(ARGV[7])
rec.preemptions = (rec.preemptions or 0) + 1
fq_add_waiting(p, rec)
return 1
