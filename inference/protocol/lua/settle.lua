-- Settle a request's token reservations to its real usage: each rate window's entry is lowered
-- from the reserved cost to the actual tokens, each budget counter from the reserved cost to
-- what the actual tokens are charged (`billed`: batch work at its price, gateway.pricing).
-- KEYS: the token windows, then the budgets, then each budget's rebuild marker (rebuild.lua);
-- ARGV[1] the spec JSON (member, actual, billed (absent: actual), costs, and optionally ledger
-- and request_id: the usage ledger entry to remove; epoch: the deployment's epoch the request
-- was admitted in; record: the primary key of its usage record). Returns -1
-- when the entry was already gone (nothing settled), else how many reservations were settled.
local spec = cjson.decode(ARGV[1])
-- With a ledger: settle only if this call removes the request's usage entry (exactly once).
if spec.ledger and redis.call('HDEL', spec.ledger, spec.request_id) == 0 then
  return -1
end
local n = 0
for _, w in ipairs(spec.windows) do
  n = n + 1
  local old = spec.member .. ':' .. w.cost
  local score = redis.call('ZSCORE', KEYS[n], old)
  if score then
    redis.call('ZREM', KEYS[n], old)
    if spec.actual > 0 then
      redis.call('ZADD', KEYS[n], score, spec.member .. ':' .. spec.actual)
    end
  end
end
local nbudgets = #spec.budgets
local billed = tonumber(spec.billed) or spec.actual
for _, b in ipairs(spec.budgets) do
  n = n + 1
  if redis.call('EXISTS', KEYS[n]) == 1 then
    -- A counter rebuilt from the usage records in another epoch than the reservation's (Redis
    -- lost its data after the admission, gateway.budgets) never held the reservation; it holds
    -- the request's usage only if its record was among those counted (record <= upto).
    local raw = redis.call('GET', KEYS[n + nbudgets])
    local marker = raw and cjson.decode(raw)
    if marker and type(spec.epoch) == 'string' and marker.epoch ~= spec.epoch then
      if type(spec.record) ~= 'number' or spec.record > (tonumber(marker.upto) or 0) then
        redis.call('INCRBY', KEYS[n], billed)
      end
    else
      redis.call('DECRBY', KEYS[n], b.cost - billed)
    end
  end
end
return n
