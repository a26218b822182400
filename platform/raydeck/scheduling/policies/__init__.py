"""Scheduling policies: which queued job starts, which running job yields, on what resources.

``core`` (the :class:`~raydeck.scheduling.policies.core.Policy` interface, its job types and
FIFO, priority with aging, shortest job first, fair share with quotas, EASY backfill),
``attained_service`` (Tiresias' LAS and Gittins), ``registry`` (a policy by its name),
``preemption`` (when a running job may be preempted, and for whom), ``elastic`` (scaling curves
of elastic jobs) and ``resources`` (what a job holds and a cluster has). Pure: no Ray, no I/O;
the simulator and the queue both drive them.
"""
