-- The shared request queue: one fair order for all the workers of a base model (docs/design.md,
-- "Across workers"). A library: every script that touches the queue is this text followed by its own
-- body, so each state change is written once (inference.protocol.keys.queue_script()).
--
-- A request waits under its priority tier and its fairness key, in arrival order. A worker takes
-- the next request by the sort key (-priority, counter[key], arrival_seq) with VTC, or
-- (-priority, arrival_seq) with FCFS. The counters are shared by every worker: each charges the
-- service it gives (inference.worker.fair_queue.FairQueue.charge). A key that becomes backlogged
-- (nothing waiting, taken or running anywhere) is lifted to the smallest counter of the
-- backlogged keys, or, when none is, to the counter of the key that went idle last (VTC, Sheng et
-- al., OSDI 2024).
--
-- One queue per base model (docs/design.md, "Several base models"): the deployment's default
-- model's keys are under {p}:fq:, another model's under {p}:fq@{model}: (p the deployment's
-- prefix). A script is given the queue's name: p, or '{p}@{model}' (fq_root, fq). The fair order,
-- VTC counters and gate 1 are each queue's own; events, the usage ledger and the epoch are the
-- deployment's. Keys of each queue:
--   seq                 string: the last arrival number given
--   tiers               zset priority -> priority: tiers with a request waiting (FQ_BATCH: -inf)
--   batch_wait          set: the batch requests waiting (kept out of gate 1)
--   ready:{prio}        zset key -> counter: keys with a request waiting in the tier
--   heads:{prio}        zset key -> arrival of its oldest waiting request in the tier
--   q:{prio}:{key}      zset request id -> arrival: the key's waiting requests in the tier
--   wait                hash request id -> record (JSON: id, key, prio, seq, deadline, body)
--   deadlines           zset request id -> admission deadline (unix s) of waiting requests
--   counter             hash key -> weighted service (VTC counter)
--   inflight            hash key -> requests waiting, taken or running
--   backlogged          zset key -> counter: keys with a request in flight
--   last_idle           string: the counter of the key that went idle last
--   taken:{worker}      hash request id -> record: taken by the worker, no event written yet
--   running:{worker}    hash request id -> record: its first event written
--   held                hash worker -> requests it took and its engine has not admitted yet
--   take                hash request id -> the token of its current take (taken or running):
--                       every take gives a new one (take.lua), and a worker's write or end of
--                       the request carries the token of its own take: a stale one (a take that
--                       was reclaimed while its worker was paused, then taken again) is refused
--   takes               string: the last take token given
--   once:{kind}:{worker} string, expiring: the token of the worker's last update of the kind
--                       (release, charge) that Redis applied: the same update sent again after a
--                       lost reply is not applied twice (fq_once)
--   reclaimed:{worker}  string, expiring: set when the worker was reclaimed (reclaim.lua), until
--                       it learns so and registers afresh; it takes nothing meanwhile
--   wake                list: one entry per enqueue, for idle workers to block on
--   wake_tier:{prio}    list: one entry per enqueue in the tier (a few kept), for workers whose
--                       rows are full to block on: they take only a higher tier than their rows
--   known_tiers         set: every tier a request was ever queued in
--   wake:{worker}       list: the worker's own wake-ups (a row of it freed, a row preempted)
--   next                hash request id -> the seq of its next token event (running requests):
--                       an event written again after a lost reply is not written twice
--   adapter_holder      hash LoRA adapter digest -> '{worker} {until}': a worker that holds the
--                       adapter loaded, until (unix s) its heartbeat renews it
--   deferred            hash request id -> unix s when a worker without its adapter first left
--                       it, at the head of the order, for a worker holding it (take.lua)
-- and the deployment's, whatever the queue:
--   {p}:fq:batch_ended:{batch}  set, expiring with the events: the ended requests of a batch
--                       (the message's meta.batch_id), for its next step (api.batch_runner)
--   {p}:fq:queues       set: the queue names other than p that a request was queued in
--   {p}:worker_queue    hash worker -> the queue name it serves (absent: p)
--   {p}:events:{id}     the request's events stream
--   {p}:usage:pending   hash request id -> usage entry of an ended request not yet recorded in
--                       the database (gateway.usage records it, then deletes it)
-- A record (JSON) holds id, key (fairness key), prio, seq (arrival), deadline, body (the request
-- message's JSON), leases (concurrency lease keys holding its id), adapter (its LoRA adapter's
-- digest, absent for the bare model), and once it runs,
-- prompt_tokens and first_at (unix s of its first event); a request preempted and waiting again
-- (preempt.lua) also usage (what it has streamed so far) and preemptions.
-- Gate 1 (requests accepted and not yet admitted) is HLEN wait + the sum of held, less the batch
-- requests waiting (batch_wait).
--
-- The batch service class (docs/design.md, "The batch service class"): a request whose message
-- says `batch` (its record's batch) waits in a tier of its own, FQ_BATCH ('batch', score -inf in
-- tiers), below every priority tier whatever its own, with the same policy among its keys (its
-- fairness key is a batch key of its own, inference.protocol.messages.batch_fairness_key). It
-- is in no known_tiers nor wake_tier list (a worker whose rows are full never takes one), and
-- batch_wait (set of request ids) keeps it out of gate 1.

-- The tier name of batch requests.
local FQ_BATCH = 'batch'

-- The deployment's prefix of a queue name: `p` is the deployment's prefix (the queue of its
-- default model) or '{prefix}@{model}' (the queue of another base model; a model name holds
-- neither ':' nor '@').
local function fq_root(p)
  local at = string.find(p, '@', 1, true)
  if at then
    return string.sub(p, 1, at - 1)
  end
  return p
end

-- A key of the queue `p`: {prefix}:fq:... for the default model, {prefix}:fq@{model}:... else.
local function fq(p, ...)
  local at = string.find(p, '@', 1, true)
  local ns = p .. ':fq'
  if at then
    ns = string.sub(p, 1, at - 1) .. ':fq@' .. string.sub(p, at + 1)
  end
  return table.concat({ns, ...}, ':')
end

-- Every queue of the deployment: the default model's, then each other one a request was ever
-- queued in (fq:queues). Whatever ends requests by their id (withdraw.lua) looks in each.
local function fq_queues(p)
  local root = fq_root(p)
  local out = {root}
  for _, q in ipairs(redis.call('SMEMBERS', fq(root, 'queues'))) do
    out[#out + 1] = q
  end
  return out
end

local function fq_counter(p, key)
  return tonumber(redis.call('HGET', fq(p, 'counter'), key) or '0')
end

-- Whether a request message (JSON) is of the batch service class.
local function fq_is_batch(body)
  local ok, message = pcall(cjson.decode, body)
  return ok and type(message) == 'table' and message.batch == true
end

-- The tier a record waits in: its priority, or FQ_BATCH.
local function fq_tier(rec)
  if rec.batch then
    return FQ_BATCH
  end
  return tostring(rec.prio)
end

local function fq_gate1(p)
  local n = redis.call('HLEN', fq(p, 'wait')) - redis.call('SCARD', fq(p, 'batch_wait'))
  local held = redis.call('HVALS', fq(p, 'held'))
  for i = 1, #held do
    n = n + tonumber(held[i])
  end
  return n
end

-- Put a request (a record table) in its place among the waiting ones.
local function fq_add_waiting(p, rec)
  local prio = fq_tier(rec)
  redis.call('ZADD', fq(p, 'q', prio, rec.key), rec.seq, rec.id)
  redis.call('HSET', fq(p, 'wait'), rec.id, cjson.encode(rec))
  if rec.deadline and rec.deadline > 0 then
    redis.call('ZADD', fq(p, 'deadlines'), rec.deadline, rec.id)
  end
  local head = redis.call('ZSCORE', fq(p, 'heads', prio), rec.key)
  if not head or tonumber(head) > rec.seq then
    redis.call('ZADD', fq(p, 'heads', prio), rec.seq, rec.key)
  end
  redis.call('ZADD', fq(p, 'ready', prio), fq_counter(p, rec.key), rec.key)
  redis.call('LPUSH', fq(p, 'wake'), '1')
  redis.call('LTRIM', fq(p, 'wake'), 0, 255)
  if rec.batch then
    redis.call('ZADD', fq(p, 'tiers'), '-inf', prio)
    redis.call('SADD', fq(p, 'batch_wait'), rec.id)
    return
  end
  redis.call('ZADD', fq(p, 'tiers'), rec.prio, prio)
  -- For the workers whose rows are full: they wait for a tier above their lowest rows only.
  redis.call('SADD', fq(p, 'known_tiers'), prio)
  redis.call('LPUSH', fq(p, 'wake_tier', prio), '1')
  redis.call('LTRIM', fq(p, 'wake_tier', prio), 0, 3)
end

-- Take a request out of the waiting ones; returns its record, or nil when it is not waiting.
local function fq_remove_waiting(p, id)
  local raw = redis.call('HGET', fq(p, 'wait'), id)
  if not raw then
    return nil
  end
  local rec = cjson.decode(raw)
  local prio = fq_tier(rec)
  redis.call('SREM', fq(p, 'batch_wait'), id)
  local queue = fq(p, 'q', prio, rec.key)
  redis.call('HDEL', fq(p, 'wait'), id)
  redis.call('HDEL', fq(p, 'deferred'), id)
  redis.call('ZREM', fq(p, 'deadlines'), id)
  redis.call('ZREM', queue, id)
  local next_head = redis.call('ZRANGE', queue, 0, 0, 'WITHSCORES')
  if #next_head == 0 then
    redis.call('ZREM', fq(p, 'heads', prio), rec.key)
    redis.call('ZREM', fq(p, 'ready', prio), rec.key)
    if redis.call('ZCARD', fq(p, 'ready', prio)) == 0 then
      redis.call('ZREM', fq(p, 'tiers'), prio)
    end
  else
    redis.call('ZADD', fq(p, 'heads', prio), next_head[2], rec.key)
  end
  return rec
end

-- A new request of `key` is in flight: lift the key if it was idle.
local function fq_backlog(p, key)
  local inflight = redis.call('HINCRBY', fq(p, 'inflight'), key, 1)
  if inflight == 1 then
    local floor = redis.call('ZRANGE', fq(p, 'backlogged'), 0, 0, 'WITHSCORES')
    local lift = tonumber(floor[2] or redis.call('GET', fq(p, 'last_idle')) or '0')
    local counter = math.max(fq_counter(p, key), lift)
    redis.call('HSET', fq(p, 'counter'), key, counter)
    redis.call('ZADD', fq(p, 'backlogged'), counter, key)
  end
end

-- A request of `key` ended (or left the queue for good).
local function fq_release(p, key)
  local inflight = redis.call('HINCRBY', fq(p, 'inflight'), key, -1)
  if inflight <= 0 then
    redis.call('HDEL', fq(p, 'inflight'), key)
    redis.call('ZREM', fq(p, 'backlogged'), key)
    redis.call('SET', fq(p, 'last_idle'), fq_counter(p, key))
  end
end

-- A new request enters the queue; returns its arrival number.
local function fq_enqueue(p, id, key, prio, deadline, body, leases, adapter)
  local seq = redis.call('INCR', fq(p, 'seq'))
  if p ~= fq_root(p) then
    redis.call('SADD', fq(fq_root(p), 'queues'), p)
  end
  fq_backlog(p, key)
  fq_add_waiting(p, {id = id, key = key, prio = tonumber(prio), seq = seq,
                     deadline = tonumber(deadline), body = body, leases = leases or {},
                     batch = fq_is_batch(body) or nil,
                     adapter = (adapter and adapter ~= '') and adapter or nil})
  return seq
end

-- The key to serve next in the highest tier with a request waiting, by the policy.
local function fq_next_key(p, policy)
  local top = redis.call('ZREVRANGE', fq(p, 'tiers'), 0, 0)
  if #top == 0 then
    return nil
  end
  local prio = top[1]
  if policy == 'fcfs' then
    return prio, redis.call('ZRANGE', fq(p, 'heads', prio), 0, 0)[1]
  end
  local least = redis.call('ZRANGE', fq(p, 'ready', prio), 0, 0, 'WITHSCORES')
  local tied = redis.call('ZRANGEBYSCORE', fq(p, 'ready', prio), least[2], least[2])
  local best, best_seq = nil, nil
  for i = 1, #tied do
    local seq = tonumber(redis.call('ZSCORE', fq(p, 'heads', prio), tied[i]))
    if best_seq == nil or seq < best_seq then
      best, best_seq = tied[i], seq
    end
  end
  return prio, best
end

-- The time now (unix s, from the server's clock).
local function fq_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end

-- A final error event (JSON) as inference.protocol.events.FinalEvent writes it (retryable unless
-- `retryable` is false).
local function fq_error_event(id, seq, code, message, details, completion_tokens, prompt_tokens,
                              cached_prompt_tokens, retryable)
  return cjson.encode({type = 'final', request_id = id, seq = seq, finish_reason = 'error',
                       usage = {prompt_tokens = prompt_tokens or 0,
                                cached_prompt_tokens = cached_prompt_tokens or 0,
                                completion_tokens = completion_tokens or 0},
                       text = '', timings = {},
                       error = {code = code, message = message, retryable = retryable ~= false,
                                details = details}})
end

-- End a request for good: its final event (JSON) in its stream, its usage entry in the ledger
-- (recorded exactly once by gateway.usage), its concurrency leases released, its key's
-- in-flight count lowered, its take token dropped, and a batch line's id added to its batch's
-- ended set (batch_ended). Every end of every request goes through here.
local function fq_finish(p, rec, event, ttl, now)
  local stream = fq_root(p) .. ':events:' .. rec.id
  redis.call('XADD', stream, '*', 'data', event)
  redis.call('EXPIRE', stream, ttl)
  redis.call('HDEL', fq(p, 'next'), rec.id)
  redis.call('HDEL', fq(p, 'take'), rec.id)
  redis.call('HSET', fq_root(p) .. ':usage:pending', rec.id,
             cjson.encode({final = event, body = rec.body, first_at = rec.first_at,
                           finished_at = now}))
  if type(rec.leases) == 'table' then
    for _, lease in ipairs(rec.leases) do
      redis.call('ZREM', lease, rec.id)
    end
  end
  fq_release(p, rec.key)
  if rec.batch then
    local ok, message = pcall(cjson.decode, rec.body)
    local meta = ok and type(message) == 'table' and message.meta
    local batch_id = type(meta) == 'table' and meta.batch_id
    if type(batch_id) == 'string' then
      local ended = fq(fq_root(p), 'batch_ended', batch_id)
      redis.call('SADD', ended, rec.id)
      redis.call('EXPIRE', ended, ttl)
    end
  end
end

-- Whether `token` is the take token of the request `id`'s current take (fq:take): a worker's
-- write for a take that is no longer the current one (reclaimed, taken again) is refused.
local function fq_owns(p, id, token)
  return redis.call('HGET', fq(p, 'take'), id) == token
end

-- Whether a worker's update of the kind (release, charge) carrying this token is new: it is
-- recorded as applied then. A worker sends its updates in order and sends one again (same token)
-- until a reply says it arrived, so only its last applied token is kept. A counter update whose
-- reply was lost (a dropped connection, Redis killed once it had written it) is thus applied
-- once, not once per try.
local FQ_ONCE_TTL_S = 86400
local function fq_once(p, kind, worker, token)
  local key = fq(p, 'once', kind, worker)
  if redis.call('GET', key) == token then
    return false
  end
  redis.call('SET', key, token, 'EX', FQ_ONCE_TTL_S)
  return true
end

-- The token events a running request's stream holds (its next seq).
local function fq_tokens_sent(p, id)
  return tonumber(redis.call('HGET', fq(p, 'next'), id) or '0')
end

-- The deployment's epoch: a random id set by the first process to find none. Redis losing its
-- data loses the epoch too, so a process that saw another one knows the state it held is gone.
local function fq_epoch(p, candidate)
  redis.call('SET', fq_root(p) .. ':epoch', candidate, 'NX')
  return redis.call('GET', fq_root(p) .. ':epoch')
end
