-- Hand requests a worker took back to their places in the queue, for any worker (after
-- fair_queue.lua): its engine could not take them (full, stopping), or the worker found them
-- recorded as its own without holding them (the reply of a take was lost). They keep their
-- arrival, so their place; gate 1 still counts them (waiting again instead of held). A take that
-- is no longer the request's current one (fq_owns: reclaimed meanwhile) changes nothing.
-- ARGV: the queue name (fair_queue.lua), worker id, then per request: its id, its take token.
-- Returns how many went back.
local p, worker = ARGV[1], ARGV[2]
local n = 0
for i = 3, #ARGV, 2 do
  local id = ARGV[i]
  local raw = redis.call('HGET', fq(p, 'taken', worker), id)
  if raw and fq_owns(p, id, ARGV[i + 1]) then
    redis.call('HDEL', fq(p, 'taken', worker), id)
    redis.call('HDEL', fq(p, 'take'), id)
    local rec = cjson.decode(raw)
    if not rec.batch then  -- a batch request was never in held (take.lua)
      redis.call('HINCRBY', fq(p, 'held'), worker, -1)
    end
    fq_add_waiting(p, rec)
    n = n + 1
  end
end
return n
