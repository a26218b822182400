"""The whole platform on one machine, without containers: ``raydeck up`` / ``down`` / ``ps`` /
``logs``.

The services of ``docker/docker-compose.yml`` as local processes: PostgreSQL, an S3 server
(SeaweedFS), the MLflow server on both, a Ray head with token authentication, Prometheus and
JupyterLab. ``services`` defines them (and is checked against the compose file), ``launchers``
knows how to start and probe each, ``supervisor`` brings them up and down in order,
``state`` owns the state directory.

Below this package, because every raydeck process reads them (:mod:`raydeck.config.settings` in
every process, Ray workers included): :mod:`raydeck.config.stack_connection`, the file through which
every raydeck process on the machine finds the running stack, and
:mod:`raydeck.config.stack_credentials`, the stack's secrets. This package's ``__init__`` imports
nothing.
"""
