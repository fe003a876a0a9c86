-- Reclaim the requests of workers whose heartbeat lapsed (after fair_queue.lua). A request a
-- dead worker took and wrote no event for goes back to its place in the queue, once: the worker
-- no longer owns it (its take token is dropped: events.lua refuses whatever it still writes). A
-- request it was running cannot be resumed without repeating tokens: it ends here with a
-- retryable worker_lost error that says how many tokens its stream holds, billed for what it
-- computed (fq_finish). The worker is marked reclaimed (fq:reclaimed:{worker}): it takes nothing
-- until it has learned so (a worker that was only paused resumes with stale requests).
-- Any process may run this (workers, web tiers, the Celery beat task): it is atomic, so each
-- dead worker is reclaimed once.
--
-- A heartbeat is judged against the judge's own sight of Redis (ARGV[4]: the seconds for which
-- the judge has seen Redis answer without a break, inference.protocol.liveness): no process can
-- beat while Redis hangs, so a judge that has not seen Redis answer for a whole TTL declares no
-- death. And when every worker's heartbeat is stale at once (the freshest one too), the silence
-- is taken for an outage, not for deaths, unless the judge saw Redis without a break for the
-- whole silence (the workers could have beaten all along: they died), or, after an outage the
-- judge did see, for twice the TTL. So the death of the only worker is reclaimed one TTL after
-- its last beat by a judge whose sight was continuous (a web process's monitor, another
-- worker), and within 2 TTL of the end of an outage that came between.
--
-- The judge's sight holds when it was measured (ARGV[5]: the judge's wall clock then, the clock
-- its heartbeats are written with): a call that reaches Redis more than half a TTL later (sent
-- as Redis stopped, and run when it went on: every heartbeat aged meanwhile, the judge's sight
-- of it did not) declares no death.
--
-- A worker starting under the id of one that died (a restart with a fixed WORKER_ID) reclaims
-- what that one left under its id first, naming it as ARGV[6] (whatever its heartbeat and the
-- judge's sight: the earlier process under this id is gone).
-- Heartbeats are the deployment's, whatever the base model: a dead worker's requests are
-- looked for in the queue it served ({p}:worker_queue), whichever queue the judge serves.
-- ARGV: a queue name (fair_queue.lua), the heartbeat TTL (s), the events' TTL (s), the judge's
-- sight (s), when it was measured (Unix s), optionally a worker id to reclaim whatever its
-- heartbeat. Returns {requeued count,
-- worker ids reclaimed (JSON list), then the ids of the requests ended}.
local p, ttl, events_ttl = fq_root(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local sight = tonumber(ARGV[4]) or 0
local measured = tonumber(ARGV[5])
-- How long a reclaimed worker's mark is kept (s): a worker paused longer finds itself reclaimed
-- by its heartbeat instead (inference.worker.bridge.WorkerBridge.publish_stats).
local MARK_TTL_S = 86400
local now = fq_now()
if not measured or now - measured > ttl / 2 then
  sight = 0
end
local dead = {}
if sight >= ttl then
  local freshest = redis.call('ZREVRANGE', p .. ':workers', 0, 0, 'WITHSCORES')
  local silence = freshest[2] and now - tonumber(freshest[2]) or 0
  if silence <= ttl or sight >= math.min(silence, 2 * ttl) then
    dead = redis.call('ZRANGEBYSCORE', p .. ':workers', '-inf', now - ttl)
  end
end
if ARGV[6] then
  local known = false
  for _, worker in ipairs(dead) do
    known = known or worker == ARGV[6]
  end
  if not known then
    dead[#dead + 1] = ARGV[6]
  end
end
local requeued, out = 0, {}
for _, worker in ipairs(dead) do
  local q = redis.call('HGET', p .. ':worker_queue', worker) or p
  local taken = redis.call('HVALS', fq(q, 'taken', worker))
  for i = 1, #taken do
    local rec = cjson.decode(taken[i])
    redis.call('HDEL', fq(q, 'take'), rec.id)
    fq_add_waiting(q, rec)
    requeued = requeued + 1
  end
  local running = redis.call('HVALS', fq(q, 'running', worker))
  for i = 1, #running do
    local rec = cjson.decode(running[i])
    local sent = fq_tokens_sent(q, rec.id)
    local event = fq_error_event(
      rec.id, sent, 'worker_lost',
      'the inference worker serving this request stopped before it finished; retry the ' ..
      'request (details.completion_tokens: the tokens this response holds)',
      {worker = worker, completion_tokens = sent}, sent, rec.prompt_tokens)
    fq_finish(q, rec, event, events_ttl, now)
    out[#out + 1] = rec.id
  end
  redis.call('DEL', fq(q, 'taken', worker), fq(q, 'running', worker), fq(q, 'wake', worker),
             p .. ':stats:' .. worker)
  redis.call('HDEL', fq(q, 'held'), worker)
  redis.call('HDEL', p .. ':worker_queue', worker)
  redis.call('ZREM', p .. ':workers', worker)
  redis.call('SET', fq(q, 'reclaimed', worker), '1', 'EX', MARK_TTL_S)
end
table.insert(out, 1, cjson.encode(dead))
table.insert(out, 1, requeued)
return out
