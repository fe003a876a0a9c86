-- Put a new request in the queue (after fair_queue.lua), without the web tier's limits: for tools
-- and tests that stand in for the web tier. ARGV: the queue name, request id, fairness key,
-- priority, admission deadline (unix s, 0: none), the message JSON, optionally its LoRA adapter's
-- digest. Returns its arrival number.
return fq_enqueue(ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], nil, ARGV[7])
