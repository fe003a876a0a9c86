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
local taken, running, next_seq = fq(p, 'taken', worker), fq(p, 'running', worker), fq(p, 'next')
local now = fq_now()
local lost = {}
-- A write carries several ticks' events of each request (a hold): what one event of a request
-- looked up (its take's ownership, its record) holds for the next of the same take until a final
-- event, and a stream's TTL and next seq are set once, after its last token of the write.
local known = {}    -- id -> {take = token, raw = record JSON or false (not owned)}
local pending = {}  -- id -> the next seq to record for it (tokens written, not yet recorded)
local streams = {}  -- the ids of `pending`, in the order of their first token here
local function record_sent(id)
  local seq = pending[id]
  if seq then
    redis.call('EXPIRE', fq_root(p) .. ':events:' .. id, ttl)
    redis.call('HSET', next_seq, id, seq)
    pending[id] = nil
  end
end
for i = 4, #ARGV, 6 do
  local id, final, seq, event = ARGV[i], ARGV[i + 1] == '1', tonumber(ARGV[i + 2]), ARGV[i + 3]
  local take = ARGV[i + 5]
  local raw = nil
  local seen = known[id]
  if seen and seen.take == take then
    raw = seen.raw or nil
  else
    if fq_owns(p, id, take) then
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
    known[id] = {take = take, raw = raw or false}
  end
  if raw then
    if final then
      record_sent(id)  -- fq_finish drops the request's next seq: set before, never after
      known[id] = nil
      redis.call('HDEL', running, id)
      fq_finish(p, cjson.decode(raw), event, ttl, now)
    else
      local sent = pending[id] or fq_tokens_sent(p, id)
      if seq >= sent then
        redis.call('XADD', fq_root(p) .. ':events:' .. id, '*', 'data', event)
        if not pending[id] then
          streams[#streams + 1] = id
        end
        pending[id] = seq + 1
      end
    end
  elseif lost[#lost - 1] ~= id or lost[#lost] ~= take then
    lost[#lost + 1] = id
    lost[#lost + 1] = take
  end
end
for _, id in ipairs(streams) do
  record_sent(id)
end
return lost
