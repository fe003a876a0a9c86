-- Reclaim the requests of workers whose heartbeat lapsed (after fair_queue.lua). A request a
-- dead worker took and wrote no event for goes back to its place in the queue, once: the worker
-- no longer owns it (events.lua drops anything it still writes). A request it was running cannot
-- be resumed without repeating tokens: it is returned, for the caller to end with an error.
-- ARGV: prefix, the time now (unix s), the heartbeat TTL (s). Returns {requeued count, worker ids
-- reclaimed (JSON list), the running records (JSON) ...}.
local p, now, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local dead = redis.call('ZRANGEBYSCORE', p .. ':workers', '-inf', now - ttl)
local requeued, out = 0, {}
for _, worker in ipairs(dead) do
  local taken = redis.call('HVALS', fq(p, 'taken', worker))
  for i = 1, #taken do
    fq_add_waiting(p, cjson.decode(taken[i]))
    requeued = requeued + 1
  end
  local running = redis.call('HVALS', fq(p, 'running', worker))
  for i = 1, #running do
    fq_release(p, cjson.decode(running[i]).key)
    out[#out + 1] = running[i]
  end
  redis.call('DEL', fq(p, 'taken', worker), fq(p, 'running', worker), p .. ':stats:' .. worker)
  redis.call('HDEL', fq(p, 'held'), worker)
  redis.call('ZREM', p .. ':workers', worker)
end
table.insert(out, 1, cjson.encode(dead))
table.insert(out, 1, requeued)
return out
