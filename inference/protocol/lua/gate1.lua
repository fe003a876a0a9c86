-- Gate 1's figure (after fair_queue.lua): requests accepted and not yet admitted by any worker.
-- ARGV: the queue name (fair_queue.lua).
return fq_gate1(ARGV[1])
