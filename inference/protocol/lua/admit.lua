-- Admission: every limit of one request, and gate 1, checked and recorded all-or-nothing; on
-- success the request joins the shared queue (fq_enqueue, from fair_queue.lua beside this file,
-- which gateway.admission puts before this text). A refused request consumes nothing.
-- KEYS: the limit keys, named by index in the spec.
-- ARGV[1] the spec (JSON, see gateway.admission.build_limits), ARGV[2] the request message JSON.
-- Returns a JSON verdict: {ok = true} or the refusal's numbers; both with `windows`, for each
-- rate window of the spec in order {used, ms until the window is empty}, this request counted
-- when admitted (gateway.ratelimits, the responses' x-ratelimit-* headers).
local spec = cjson.decode(ARGV[1])
-- The same request admitted again (a retried call whose reply was lost): its first verdict.
local marker = fq_root(spec.prefix) .. ':admitted:' .. spec.member
local earlier = redis.call('GET', marker)
if earlier then
  return earlier
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function member_cost(member)
  return tonumber(string.match(member, ':(%d+)$')) or 1
end

-- Every rate window's use now, once the entries older than the window have left it.
local uses = {}
for i, w in ipairs(spec.windows) do
  redis.call('ZREMRANGEBYSCORE', KEYS[w.key], '-inf', now - spec.window_ms)
  local entries = redis.call('ZRANGE', KEYS[w.key], 0, -1, 'WITHSCORES')
  local used = 0
  for j = 1, #entries, 2 do used = used + member_cost(entries[j]) end
  -- Scores ascend: the last is the newest entry's time, the last to leave the window.
  local newest = #entries > 0 and tonumber(entries[#entries]) or nil
  uses[i] = {entries = entries, used = used, newest = newest}
end
local function windows(admitted)
  local out = {}
  for i, w in ipairs(spec.windows) do
    if admitted then
      out[i] = {uses[i].used + w.cost, spec.window_ms}
    elseif uses[i].newest then
      out[i] = {uses[i].used, uses[i].newest + spec.window_ms - now}
    else
      out[i] = {uses[i].used, 0}
    end
  end
  return out
end
local function refuse(code, what, limit, used, cost, retry_ms, retryable)
  return cjson.encode({ok = false, code = code, what = what, limit = limit, used = used,
                       cost = cost, retry_after_ms = retry_ms, retryable = retryable,
                       windows = windows(false)})
end

for _, b in ipairs(spec.budgets) do
  local used = tonumber(redis.call('GET', KEYS[b.key]) or '0')
  if used + b.cost > b.limit then
    -- Not retryable before the period ends, when the counter starts again from 0.
    local resets_ms = b.ends_at and math.max(0, b.ends_at * 1000 - now) or 0
    return refuse('token_budget_exhausted', b.what, b.limit, used, b.cost, resets_ms, false)
  end
end

for i, w in ipairs(spec.windows) do
  if w.cost > w.limit then
    return refuse('rate_limit_exceeded', w.what, w.limit, 0, w.cost, 0, false)
  end
  local entries, used = uses[i].entries, uses[i].used
  if used + w.cost > w.limit then
    -- The oldest entries leave the window first: wait until enough of them have.
    local freed = 0
    local retry_ms = spec.window_ms
    for j = 1, #entries, 2 do
      freed = freed + member_cost(entries[j])
      if used - freed + w.cost <= w.limit then
        retry_ms = tonumber(entries[j + 1]) + spec.window_ms - now
        break
      end
    end
    return refuse('rate_limit_exceeded', w.what, w.limit, used, w.cost, retry_ms, true)
  end
end

for _, c in ipairs(spec.concurrency) do
  local key = KEYS[c.key]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local used = redis.call('ZCARD', key)
  if used >= c.limit then
    return refuse('concurrency_limit_exceeded', c.what, c.limit, used, 1, 1000, true)
  end
end

-- Gate 1 bounds interactive requests: a batch one (its message's `batch`) neither counts in it
-- nor is refused by it (docs/design.md, "The batch service class").
local queued = fq_gate1(spec.prefix)
if not fq_is_batch(ARGV[2]) and queued >= spec.max_queue then
  return refuse('queue_full', 'requests waiting for a worker', spec.max_queue, queued, 1, 1000,
                true)
end

for _, b in ipairs(spec.budgets) do
  redis.call('INCRBY', KEYS[b.key], b.cost)
  redis.call('EXPIRE', KEYS[b.key], b.ttl_s)
end
for _, w in ipairs(spec.windows) do
  redis.call('ZADD', KEYS[w.key], now, spec.member .. ':' .. w.cost)
  redis.call('PEXPIRE', KEYS[w.key], spec.window_ms)
end
for _, c in ipairs(spec.concurrency) do
  redis.call('ZADD', KEYS[c.key], now + spec.lease_ms, spec.member)
  redis.call('PEXPIRE', KEYS[c.key], spec.lease_ms)
end
local leases = {}
for _, c in ipairs(spec.concurrency) do
  leases[#leases + 1] = KEYS[c.key]
end
fq_enqueue(spec.prefix, spec.member, spec.fairness_key, spec.priority, spec.deadline, ARGV[2],
           leases, spec.adapter)
local verdict = cjson.encode({ok = true, windows = windows(true),
                              epoch = fq_epoch(spec.prefix, spec.epoch)})
redis.call('SET', marker, verdict, 'EX', spec.marker_ttl_s)
return verdict
