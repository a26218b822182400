"""The job queue: raydeck's scheduler on a running Ray cluster (``raydeck submit --queue``).

The state machine: ``job_queue`` (:class:`~raydeck.scheduling.queue.job_queue.JobQueue`),
``store`` (its SQLite records), ``jobspec``, ``job_view``, ``identity`` and ``access`` (who may
change what), ``job_changes``, ``reconcile``, ``resizing``, ``listing``, ``configuration`` and
``config_change``, ``failures``, ``submission`` and ``launcher``. Its adapters to the cluster:
``job_server`` (which job server: the cluster's own), ``ray_jobs`` (Ray's job server),
``serve_apps`` (Serve's replicas, bounded as elastic jobs),
``history`` and ``witness`` (MLflow). The named actor is ``actor``; ``client`` is what the CLI
calls.
"""
