-- Write a worker's events to their requests' event streams (after fair_queue.lua), only for the
-- takes the worker still owns: each event carries the take token of the take it belongs to, and
-- one whose take is not the request's current one at this worker (reclaimed while its worker
-- was silent, and perhaps taken again since, by this worker or another) is dropped here. A
-- request's first event marks it running (it can no longer be handed to another worker) and
-- records its prompt's tokens and the time; its final event ends it (fq_finish). A token event
-- whose seq was already written (the reply to an earlier call was lost and the call repeated) is
-- not written again, so a retry never doubles a token.
-- ARGV: the worker's queue name (fair_queue.lua), worker id, events' TTL (s), then per event:
-- request id, "1" if final else "0", its seq, the event's JSON, the prompt's token count ("" when
-- not known), its take token. Returns the request id and take token of each take whose events were
-- dropped (once per run of its events), flat: {id, token, id, token, ...}.
local p, worker, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
local taken, running = fq(p, 'taken', worker), fq(p, 'running', worker)
local now = fq_now()
local lost = {}
for i = 4, #ARGV, 6 do
  local id, final, seq, event = ARGV[i], ARGV[i + 1] == '1', tonumber(ARGV[i + 2]), ARGV[i + 3]
  local raw = nil
  if fq_owns(p, id, ARGV[i + 5]) then
    raw = redis.call('HGET', running, id)
    if not raw then
      raw = redis.call('HGET', taken, id)
      if raw then
        local rec = cjson.decode(raw)
        -- A request preempted and taken again keeps its first run's (its prompt, its TTFT).
        rec.prompt_tokens = tonumber(ARGV[i + 4]) or rec.prompt_tokens
        -- Its first token's time: a final event first (a stop before any token) has none.
        local usage = final and cjson.decode(event).usage
        if not final or (type(usage) == 'table' and (tonumber(usage.completion_tokens) or 0) > 0) then
          rec.first_at = rec.first_at or now
        end
        raw = cjson.encode(rec)
        redis.call('HDEL', taken, id)
        redis.call('HSET', running, id, raw)
      end
    end
  end
  if raw then
    if final then
      redis.call('HDEL', running, id)
      fq_finish(p, cjson.decode(raw), event, ttl, now)
    elseif seq >= fq_tokens_sent(p, id) then
      local stream = fq_root(p) .. ':events:' .. id
      redis.call('XADD', stream, '*', 'data', event)
      redis.call('EXPIRE', stream, ttl)
      redis.call('HSET', fq(p, 'next'), id, seq + 1)
    end
  elseif lost[#lost - 1] ~= id or lost[#lost] ~= ARGV[i + 5] then
    lost[#lost + 1] = id
    lost[#lost + 1] = ARGV[i + 5]
  end
end
return lost
