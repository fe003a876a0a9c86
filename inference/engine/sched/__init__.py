"""The continuous-batching scheduler (:class:`~inference.engine.sched.scheduler.Scheduler`) and
the parts it is made of: the state its phases share (queues, KV pool, reservation, counters), a
row's lifecycle through the queues, admission with gates 2 and 3 and priority preemption, the
mixed-batch pass and its ITL-targeted prompt budget, the fairness policies, the stats, and what a
tick emits.
"""
