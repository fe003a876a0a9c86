-- Reclaim the requests of workers whose heartbeat lapsed (after fair_queue.lua). A request a
-- dead worker took and wrote no event for goes back to its place in the queue, once: the worker
-- no longer owns it (events.lua drops anything it still writes). A request it was running cannot
-- be resumed without repeating tokens: it ends here with a retryable worker_lost error that says
-- how many tokens its stream holds, billed for what it computed (fq_finish).
-- Any process may run this (workers, web tiers, the Celery beat task): it is atomic, so each
-- dead worker is reclaimed once.
-- A worker starting under the id of one that died (a restart with a fixed WORKER_ID) reclaims
-- what that one left under its id first, naming it as ARGV[4].
-- ARGV: prefix, the heartbeat TTL (s), the events' TTL (s), optionally a worker id to reclaim
-- whatever its heartbeat. Returns {requeued count, worker ids reclaimed (JSON list), then the ids
-- of the requests ended}.
local p, ttl, events_ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local now = fq_now()
local dead = redis.call('ZRANGEBYSCORE', p .. ':workers', '-inf', now - ttl)
if ARGV[4] then
  local known = false
  for _, worker in ipairs(dead) do
    known = known or worker == ARGV[4]
  end
  if not known then
    dead[#dead + 1] = ARGV[4]
  end
end
local requeued, out = 0, {}
for _, worker in ipairs(dead) do
  local taken = redis.call('HVALS', fq(p, 'taken', worker))
  for i = 1, #taken do
    fq_add_waiting(p, cjson.decode(taken[i]))
    requeued = requeued + 1
  end
  local running = redis.call('HVALS', fq(p, 'running', worker))
  for i = 1, #running do
    local rec = cjson.decode(running[i])
    local sent = fq_tokens_sent(p, rec.id)
    local event = fq_error_event(
      rec.id, sent, 'worker_lost',
      'the inference worker serving this request stopped after ' .. sent ..
      ' token(s); retry the request',
      {worker = worker, completion_tokens = sent}, sent, rec.prompt_tokens)
    fq_finish(p, rec, event, events_ttl, now)
    out[#out + 1] = rec.id
  end
  redis.call('DEL', fq(p, 'taken', worker), fq(p, 'running', worker), fq(p, 'wake', worker),
             p .. ':stats:' .. worker)
  redis.call('HDEL', fq(p, 'held'), worker)
  redis.call('ZREM', p .. ':workers', worker)
end
table.insert(out, 1, cjson.encode(dead))
table.insert(out, 1, requeued)
return out
