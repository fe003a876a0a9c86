"""The continuous-batching scheduler (:class:`~inference.engine.sched.scheduler.Scheduler`) and
the parts it is made of: admission with gates 2 and 3 and priority preemption, the mixed-batch
pass and its ITL-targeted prompt budget, the fairness policies, and what a tick emits.
"""
