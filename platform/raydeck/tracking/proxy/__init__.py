"""The proxy side of tracking: the named Ray actors that batch every rank's data into MLflow.

``actors`` (the actors' names, how they are found or started, and waiting for runs to land),
``router`` (run membership and liveness; ``outbox``: its updates to the shards; ``liveness``),
``shard`` and ``shard_actor`` (per-run queues and their MLflow writes; ``run_queue``,
``run_writes``, ``cross_rank``, ``log_upload``), ``spool`` (the SQLite spool that makes a value
acknowledged), ``dead_letters``, ``writer`` (MLflow calls and the failure policy),
``run_lookup`` and ``metrics``. ``docs/tracking-contract.md`` says what each fault does.

Never imports the worker side (:mod:`raydeck.tracking.client`).
"""
