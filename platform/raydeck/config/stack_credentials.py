"""The stack's credentials: generated on the first ``raydeck up``, kept in one file only its owner
can read, never printed.

The file is ``<state dir>/credentials.env`` in the format and with the names of
``docker/.env.example`` (``RAY_AUTH_TOKEN``, ``RAYDECK_S3_SECRET_ACCESS_KEY``,
``POSTGRES_PASSWORD``, ``JUPYTER_TOKEN``, plus the non-secret ``RAYDECK_S3_ACCESS_KEY_ID``), so
the same values could seed a compose deployment. It is created with mode 0600 (``O_EXCL``: never
over an existing one) and re-tightened to 0600 whenever it is read.

Values are :class:`~raydeck.config.secrets.Secret` objects: ``repr`` and ``str`` never show them,
and :func:`mask` replaces each one in text a person will read (``raydeck logs``, error lines).
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from raydeck.config.secrets import Secret
from raydeck.errors import StackError

FILE_MODE = 0o600
# The credentials `raydeck up` generates, under docker/.env.example's names (compose needs
# GRAFANA_ADMIN_PASSWORD too; the local stack runs no Grafana).
SECRET_NAMES = ("RAY_AUTH_TOKEN", "RAYDECK_S3_SECRET_ACCESS_KEY", "POSTGRES_PASSWORD",
                "JUPYTER_TOKEN")
ACCESS_KEY_ID = "raydeck"
ACCESS_KEY_ID_NAME = "RAYDECK_S3_ACCESS_KEY_ID"
# 32 random bytes as hex for every secret (MinIO and SeaweedFS accept 8-40+ characters).
SECRET_BYTES = 32
MASK = "********"
_LINE = re.compile(r"^([A-Z][A-Z0-9_]*)=(.*)$")
HEADER = ("# The stack's credentials, written by the first `raydeck up` (names as in "
          "docker/.env.example).\n# Only its owner may read this file; raydeck never prints "
          "these values.\n")


@dataclass(frozen=True)
class Credentials:
    """The stack's credentials; build with :func:`load_or_create`."""

    ray_auth_token: Secret
    s3_access_key_id: str
    s3_secret_access_key: Secret
    postgres_password: Secret
    jupyter_token: Secret

    def secrets(self) -> tuple[Secret, ...]:
        return (self.ray_auth_token, self.s3_secret_access_key, self.postgres_password,
                self.jupyter_token)

    def mask(self, text: str) -> str:
        """``text`` with every secret value replaced by ``********``."""
        return mask(text, self.secrets())


def mask(text: str, values: tuple[Secret, ...]) -> str:
    """``text`` with each of ``values`` replaced by ``********`` (longest first)."""
    for value in sorted((v.reveal() for v in values if v), key=len, reverse=True):
        text = text.replace(value, MASK)
    return text


def _render(values: dict[str, str]) -> str:
    return HEADER + "".join(f"{name}={value}\n" for name, value in values.items())


def _parse(path: Path) -> dict[str, str]:
    values = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _LINE.match(line.strip())
        if not match:
            raise StackError(f"stack: {path} line {number} is not NAME=value; fix it, or delete "
                             "the file to generate new credentials (`raydeck down --purge` "
                             "first: the services keep the old ones)")
        values[match.group(1)] = match.group(2)
    return values


def read(path: Path) -> Credentials:
    """The credentials in ``path``; tightens the file to 0600 if it was opened up.

    Raises:
        StackError: the file cannot be read or lacks a value.
    """
    try:
        if stat.S_IMODE(path.stat().st_mode) != FILE_MODE:
            path.chmod(FILE_MODE)
        values = _parse(path)
    except OSError as exc:
        raise StackError(f"stack: cannot read the credentials file {path} ({exc.strerror}); "
                         "run raydeck as the user who ran `raydeck up`") from None
    missing = [name for name in (*SECRET_NAMES, ACCESS_KEY_ID_NAME) if not values.get(name)]
    if missing:
        raise StackError(f"stack: {path} has no value for {', '.join(missing)}; restore it, or "
                         "start afresh with `raydeck down --purge` (deletes the stack's data)")
    return Credentials(
        ray_auth_token=Secret(values["RAY_AUTH_TOKEN"]),
        s3_access_key_id=values[ACCESS_KEY_ID_NAME],
        s3_secret_access_key=Secret(values["RAYDECK_S3_SECRET_ACCESS_KEY"]),
        postgres_password=Secret(values["POSTGRES_PASSWORD"]),
        jupyter_token=Secret(values["JUPYTER_TOKEN"]),
    )


def load_or_create(path: Path) -> Credentials:
    """The credentials in ``path``, generated first if the file does not exist.

    The file is created with ``O_EXCL`` and mode 0600 before anything is written to it, so no
    other user ever sees its content, and two ``raydeck up`` never write two sets.
    """
    if not path.exists():
        values = {name: secrets.token_hex(SECRET_BYTES) for name in SECRET_NAMES}
        values[ACCESS_KEY_ID_NAME] = ACCESS_KEY_ID
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        except FileExistsError:
            return read(path)
        with os.fdopen(fd, "w") as handle:
            handle.write(_render(values))
    return read(path)
