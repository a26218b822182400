"""Object storage (MinIO or any S3): one configuration, derived for every tool that needs it.

Owns: turning :class:`~raydeck.config.StorageSettings` into what MLflow/boto3 read from the
environment. The storage issue extends this module with the pyarrow filesystem for Ray Train,
the MinIO client and bucket bootstrap.
"""

from __future__ import annotations

from raydeck.config import StorageSettings


def secret_env(storage: StorageSettings) -> dict[str, str]:
    """Environment that lets MLflow, boto3 and raydeck itself reach the bucket store.

    Holds the secret, so it goes only into process environments and Ray runtime envs built in
    memory, never into files, logs, MLflow params or tags. Empty when storage is not configured.
    """
    if not storage.configured:
        return {}
    return {
        "MLFLOW_S3_ENDPOINT_URL": storage.endpoint,
        "AWS_ACCESS_KEY_ID": storage.access_key_id,
        "AWS_SECRET_ACCESS_KEY": storage.secret_access_key.reveal(),
        "AWS_DEFAULT_REGION": storage.region,
        "RAYDECK_S3_SECRET_ACCESS_KEY": storage.secret_access_key.reveal(),
    }


def health(storage: StorageSettings) -> tuple[list[tuple[str, str, str]], str | None]:
    """Rows for ``raydeck status`` about object storage, and an error line if unreachable."""
    if not storage.configured:
        return [("storage", "not configured", "artifacts and checkpoints on local disk")], None
    import socket
    from urllib.parse import urlparse

    parsed = urlparse(storage.endpoint)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=5):
            pass
    except OSError as exc:
        return [("storage", storage.endpoint, f"[red]unreachable[/]: {exc}")], (
            f"S3 endpoint {storage.endpoint} is unreachable (access key id "
            f"{storage.access_key_id}); start it or fix RAYDECK_S3_ENDPOINT"
        )
    return [("storage", storage.endpoint, "reachable")], None
