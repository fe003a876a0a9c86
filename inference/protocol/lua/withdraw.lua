-- Take waiting requests out of the queue for good and end them (after fair_queue.lua): their
-- client left ("ids": finish reason abort), or their admission deadline passed ("expired": a
-- retryable queue_timeout error; a batch request's own deadline: batch_expired). Any process may run this; each request ends once (fq_finish).
-- Whatever queue the caller names, every queue of the deployment is looked in (fq_queues): a
-- client's abort does not know which base model's queue its request waits in.
-- ARGV: a queue name (fair_queue.lua), the events' TTL (s), then "ids" and request ids, or
-- "expired" and a limit (per queue). Returns the ids of the requests ended.
local ttl, mode = tonumber(ARGV[2]), ARGV[3]
local now = fq_now()
local out = {}
for _, p in ipairs(fq_queues(ARGV[1])) do
  local ids = {}
  if mode == 'expired' then
    ids = redis.call('ZRANGEBYSCORE', fq(p, 'deadlines'), '-inf', now, 'LIMIT', 0, ARGV[4])
  else
    for i = 4, #ARGV do
      ids[#ids + 1] = ARGV[i]
    end
  end
  for i = 1, #ids do
    local rec = fq_remove_waiting(p, ids[i])
    if rec then
      local event
      -- A request preempted and waiting again has streamed tokens: its final event follows them
      -- and bills them (its record's usage); any other waiting request has streamed nothing.
      local seq = fq_tokens_sent(p, rec.id)
      local usage = rec.usage or {prompt_tokens = 0, cached_prompt_tokens = 0,
                                  completion_tokens = 0}
      if mode == 'expired' and rec.batch then
        -- A batch request's deadline is its own completion window (docs/design.md, "The batch
        -- service class"): past it, it ends with batch_expired, which a retry cannot help.
        event = fq_error_event(
          rec.id, seq, 'batch_expired', 'the batch request did not finish before its deadline',
          {batch_deadline_at = rec.deadline}, usage.completion_tokens, usage.prompt_tokens,
          usage.cached_prompt_tokens, false)
      elseif mode == 'expired' then
        local message = cjson.decode(rec.body)
        local allowed = tonumber(message.queue_deadline_s) or 0
        local since = message.enqueued_at
        if type(message.resume) == 'table' then
          since = message.resume.requeued_at
        end
        local waited = now - (tonumber(since) or now)
        event = fq_error_event(
          rec.id, seq, 'queue_timeout',
          string.format('request waited %.1f s for a worker, more than the allowed %g s', waited,
                        allowed),
          {max_queue_wait_s = allowed}, usage.completion_tokens, usage.prompt_tokens,
          usage.cached_prompt_tokens)
      else
        event = cjson.encode({type = 'final', request_id = rec.id, seq = seq,
                              finish_reason = 'abort', text = '', timings = {}, usage = usage})
      end
      fq_finish(p, rec, event, ttl, now)
      out[#out + 1] = rec.id
    end
  end
end
return out
