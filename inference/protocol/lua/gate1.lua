-- Gate 1's figure (after fair_queue.lua): requests accepted and not yet admitted by any worker.
-- ARGV: prefix.
return fq_gate1(ARGV[1])
