-- Rebuild a token budget counter Redis no longer has (gateway.budgets.ensure_counter), once:
-- set only if it is still missing, with a marker of what it was rebuilt from (the deployment's
-- epoch then, and the last usage record counted), which settle.lua reads: a reservation made in
-- another epoch is not in the rebuilt counter, and its usage is in it only if its record was
-- counted.
-- KEYS: the counter, its marker, the deployment's epoch key. ARGV: the tokens used (the usage
-- records of the period), the expiry (s), the largest primary key of the records counted (0:
-- none), an epoch to set when there is none. Returns 1 when this call set the counter, else 0.
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then
  return 0
end
redis.call('SET', KEYS[3], ARGV[4], 'NX')
local marker = {epoch = redis.call('GET', KEYS[3]), upto = tonumber(ARGV[3])}
redis.call('SET', KEYS[2], cjson.encode(marker), 'EX', ARGV[2])
return 1
