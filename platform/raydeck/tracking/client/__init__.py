"""The worker side of tracking: what every process that logs holds.

``attach`` (:func:`~raydeck.tracking.get_tracker`: which run, which mode), ``tracker`` (the
MLflow-like API), ``noop`` (the tracker of a rank that does not log), ``modes``, ``validation``,
``step_policy`` (steps, and skipping those a resumed run already holds), ``resume`` (Ray Train
context and resume), ``delivery`` (the bounded buffer, the flusher, heartbeats), ``lifecycle``
(exit, signals), ``train_handoff`` and ``tune_outcome`` (Ray Train's and Tune's callbacks),
``console``, ``system_metrics``, ``artifacts`` and ``artifact_logging``, ``repro``, ``context``
(what a process knows of its Ray job), and ``preemption`` (the queue's answer a job reads at
each committed checkpoint, ``Tracker.should_preempt``).

Imports the proxy's actor handles (:mod:`raydeck.tracking.proxy.actors`) and the messages, never
the proxy's internals; nothing here imports the queue, Serve, the stack or the CLI.
"""
