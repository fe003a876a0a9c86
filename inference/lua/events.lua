-- Write a worker's events to their requests' event streams (after fair_queue.lua), only for the
-- requests the worker still owns: a request reclaimed from it (its heartbeat lapsed) is another
-- worker's now, and its events are dropped here. A request's first event marks it running (it can
-- no longer be handed to another worker); its final event ends it in the queue's accounting.
-- ARGV: prefix, worker id, events' TTL (s), then per event: request id, "1" if final else "0",
-- the event's JSON. Returns the ids of requests the worker does not own.
local p, worker, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local taken, running = fq(p, 'taken', worker), fq(p, 'running', worker)
local lost = {}
for i = 4, #ARGV, 3 do
  local id, final, event = ARGV[i], ARGV[i + 1] == '1', ARGV[i + 2]
  local raw = redis.call('HGET', running, id)
  if not raw then
    raw = redis.call('HGET', taken, id)
    if raw then
      redis.call('HDEL', taken, id)
      redis.call('HSET', running, id, raw)
    end
  end
  if raw then
    local stream = p .. ':events:' .. id
    redis.call('XADD', stream, '*', 'data', event)
    redis.call('EXPIRE', stream, ttl)
    if final then
      redis.call('HDEL', running, id)
      fq_release(p, cjson.decode(raw).key)
    end
  elseif lost[#lost] ~= id then
    lost[#lost + 1] = id
  end
end
return lost
