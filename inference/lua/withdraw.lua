-- Take a waiting request out of the queue for good (after fair_queue.lua): its client left, or
-- its admission deadline passed. Returns the records withdrawn (JSON).
-- ARGV: prefix, "ids" then request ids, or "expired" then the time now (unix s) and a limit.
local p, mode = ARGV[1], ARGV[2]
local ids = {}
if mode == 'expired' then
  ids = redis.call('ZRANGEBYSCORE', fq(p, 'deadlines'), '-inf', ARGV[3], 'LIMIT', 0, ARGV[4])
else
  for i = 3, #ARGV do
    ids[#ids + 1] = ARGV[i]
  end
end
local out = {}
for i = 1, #ids do
  local rec = fq_remove_waiting(p, ids[i])
  if rec then
    fq_release(p, rec.key)
    out[#out + 1] = cjson.encode(rec)
  end
end
return out
