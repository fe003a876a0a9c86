-- Hand requests a worker took back to their places in the queue, for any worker (after
-- fair_queue.lua): its engine could not take them (full, stopping). They keep their arrival, so
-- their place; gate 1 still counts them (waiting again instead of held).
-- ARGV: prefix, worker id, request ids. Returns how many went back.
local p, worker = ARGV[1], ARGV[2]
local n = 0
for i = 3, #ARGV do
  local raw = redis.call('HGET', fq(p, 'taken', worker), ARGV[i])
  if raw then
    redis.call('HDEL', fq(p, 'taken', worker), ARGV[i])
    redis.call('HINCRBY', fq(p, 'held'), worker, -1)
    fq_add_waiting(p, cjson.decode(raw))
    n = n + 1
  end
end
return n
