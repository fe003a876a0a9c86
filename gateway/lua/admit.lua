-- Admission: every limit of one request, and gate 1, checked and recorded all-or-nothing; on
-- success the request is dispatched to its priority tier's requests stream (the enqueue at the
-- end is inference/lua/enqueue.lua's). A refused request consumes nothing.
-- KEYS[1] the gate-1 counter, KEYS[2] the request's tier stream, KEYS[3] the tier registry,
-- KEYS[4..] the limit keys, named by index in the spec.
-- ARGV[1] the spec (JSON, see gateway.admission.build_limits), ARGV[2] the request message JSON,
-- ARGV[3] str(priority). Returns a JSON verdict: {ok = true} or the refusal's numbers.
local spec = cjson.decode(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function refuse(code, what, limit, used, cost, retry_ms, retryable)
  return cjson.encode({ok = false, code = code, what = what, limit = limit, used = used,
                       cost = cost, retry_after_ms = retry_ms, retryable = retryable})
end
local function member_cost(member)
  return tonumber(string.match(member, ':(%d+)$')) or 1
end

for _, b in ipairs(spec.budgets) do
  local used = tonumber(redis.call('GET', KEYS[b.key]) or '0')
  if used + b.cost > b.limit then
    return refuse('token_budget_exhausted', b.what, b.limit, used, b.cost, 0, false)
  end
end

for _, w in ipairs(spec.windows) do
  local key = KEYS[w.key]
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - spec.window_ms)
  if w.cost > w.limit then
    return refuse('rate_limit_exceeded', w.what, w.limit, 0, w.cost, 0, false)
  end
  local entries = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
  local used = 0
  for i = 1, #entries, 2 do used = used + member_cost(entries[i]) end
  if used + w.cost > w.limit then
    -- The oldest entries leave the window first: wait until enough of them have.
    local freed = 0
    local retry_ms = spec.window_ms
    for i = 1, #entries, 2 do
      freed = freed + member_cost(entries[i])
      if used - freed + w.cost <= w.limit then
        retry_ms = tonumber(entries[i + 1]) + spec.window_ms - now
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

local queued = tonumber(redis.call('GET', KEYS[1]) or '0')
if queued >= spec.max_queue then
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
redis.call('INCR', KEYS[1])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[3])
if redis.call('EXISTS', KEYS[2]) == 0 then
  redis.pcall('XGROUP', 'CREATE', KEYS[2], spec.group, '0', 'MKSTREAM')
end
redis.call('XADD', KEYS[2], '*', 'data', ARGV[2])
return cjson.encode({ok = true})
