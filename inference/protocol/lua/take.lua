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
--
-- Adapter affinity (docs/design.md, "LoRA adapters"): ARGV[7], the LoRA adapters this worker
-- holds loaded (digests, comma-separated), and ARGV[8], the most seconds a request may wait for a
-- worker that holds its adapter. A worker that does not hold the adapter of the order's next
-- request, while another live worker does (adapter_holder), leaves it there and takes nothing
-- more this time, for at most that long from the first time a worker left it (deferred); then
-- any worker takes it. The order itself never changes: only who takes its head, and when.
local p, worker, n, policy = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local above = tonumber(ARGV[5])
local batch_extra = tonumber(ARGV[6]) or 0
local mine, affinity_s = {}, tonumber(ARGV[8]) or 0
for digest in string.gmatch(ARGV[7] or '', '[^,]+') do
  mine[digest] = true
end
if redis.call('EXISTS', fq(p, 'reclaimed', worker)) == 1 then
  return redis.status_reply('RECLAIMED')
end
local out = {}
-- Whether this worker leaves request `id` (the order's next) to a worker holding its adapter.
local function leave_for_holder(id)
  if affinity_s <= 0 then
    return false
  end
  local raw = redis.call('HGET', fq(p, 'wait'), id)
  -- (the record's own field: inside its body's JSON text every quote is escaped)
  local adapter = raw and string.match(raw, '"adapter":"(%x+)"')
  if not adapter or mine[adapter] then
    return false
  end
  local holder = redis.call('HGET', fq(p, 'adapter_holder'), adapter)
  if not holder then
    return false
  end
  local who, untils = string.match(holder, '^(%S+) (%S+)$')
  local now = fq_now()
  if who == worker or not untils or tonumber(untils) < now then
    return false
  end
  redis.call('HSETNX', fq(p, 'deferred'), id, now)
  return now - tonumber(redis.call('HGET', fq(p, 'deferred'), id)) < affinity_s
end
local function take_one(prio, key)
  local id = redis.call('ZRANGE', fq(p, 'q', prio, key), 0, 0)[1]
  if leave_for_holder(id) then
    return false
  end
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
  return true
end
for _ = 1, n do
  local prio, key = fq_next_key(p, policy)
  if not key or (above and (prio == FQ_BATCH or tonumber(prio) <= above)) then
    break
  end
  if not take_one(prio, key) then
    return out
  end
end
-- Batch work sorts after every interactive request: the extra ones are the order's next ones
-- once no interactive request waits.
for _ = 1, batch_extra do
  local prio, key = fq_next_key(p, policy)
  if not key or prio ~= FQ_BATCH or not take_one(prio, key) then
    break
  end
end
return out
