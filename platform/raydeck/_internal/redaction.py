"""The one redaction policy for everything a person, a log or a store sees.

Owns: what counts as a secret and how it is hidden, for every output raydeck produces (the CLI's
tables and error lines, log records, runtime envs, run tags and artifacts, the tracking proxy's
status and errors, ``dashboards push``). Three rules, applied together:

1. **URL user-info** is removed: ``http://bob:pw@host`` shows as ``http://host``, also for
   ``postgresql://user:pw@db/x``, a password holding ``/`` or ``@`` (written unescaped, as
   people do) and inside longer text. A bare token (``https://TOKEN@host``) goes the same way.
   User-info is a credential even without a password.
2. **Secret-named variables** have their values masked (:data:`MASK`): see
   :func:`is_secret_name`. This covers ``NAME=value`` inside text, ``--name=value`` and
   ``--name value`` (on command lines and inside text), ``?token=...`` in URLs, JSON and YAML
   keys (``{"AWS_SECRET_ACCESS_KEY": "..."}``, ``password: ...``) and headers
   (``Authorization: Bearer ...``). A ``${NAME}`` reference is not a value and stays visible.
3. **Known secret values** found verbatim in text are masked: the values of secret-named
   variables and the passwords of URLs in this process's environment (:func:`secret_values`), so
   a message that quotes a credential in an unexpected shape (a DSN without a scheme, a password
   echoed by a server) is still caught.

Does not own: keeping secrets from travelling in the first place
(:class:`raydeck.config.secrets.Secret`, :func:`raydeck.storage.secret_env`,
:func:`raydeck.cluster.connection.job_runtime_env` decide that), nor which token goes to which Ray
cluster (:func:`raydeck.jobs.submission.auth_token`). This module imports nothing from raydeck, so
every other module (errors and config included) can use it.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from urllib.parse import unquote

MASK = "********"
# Shorter secret values are not searched for in free text: replacing every "abc" of a message
# would make it unreadable. They are still masked by name and as URL user-info.
MIN_SECRET_CHARS = 4

# A name is secret when one of its words is one of these (words: split at _ - . and camelCase).
_SECRET_WORDS = frozenset({
    "SECRET", "SECRETS", "PASSWORD", "PASSWORDS", "PASSWD", "PASS", "PASSPHRASE", "TOKEN",
    "TOKENS", "CREDENTIAL", "CREDENTIALS", "DSN", "APIKEY", "AUTHORIZATION", "COOKIE",
})
# ... or when its last word is one of these (``*_API_KEY``, ``*_PRIVATE_KEY``, and the ``*_KEY``
# partner of a ``*_KEY_ID``; ``BASIC_AUTH``; a presigned URL's ``X-Amz-Signature``).
_SECRET_LAST_WORDS = frozenset({"KEY", "AUTH", "SIGNATURE"})
# ... unless its last word says the value only points at the secret (``RAY_AUTH_TOKEN_PATH``)
# or is an address, whose user-info rule 1 removes.
_POINTER_LAST_WORDS = frozenset({"PATH", "FILE", "DIR", "MODE", "URL", "URI", "ENABLED"})
# ... or when it names a kind of exception (``NoCredentialsError: Unable to locate credentials``,
# an exception as Python prints it): the text after it is a message, never a credential.
_EXCEPTION_LAST_WORDS = frozenset({"ERROR", "EXCEPTION", "WARNING"})
# Names whose values are addresses: shown with rule 1 applied even without a scheme.
_ADDRESS_LAST_WORDS = frozenset({"URL", "URI", "ENDPOINT", "ADDRESS", "LOCATION", "HOST"})

# Switch values of secret-named flags (``HF_HUB_DISABLE_IMPLICIT_TOKEN=true``): not secrets, and
# masking every "true" of a text would garble it.
_NOT_SECRET_VALUES = frozenset({"true", "false", "yes", "no", "on", "off", "none", "null"})
_PLACEHOLDER = re.compile(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}")
# scheme://user-info@. A bare token runs to the last "@" before the path; a password (after
# "user:") to the last "@" before a space or quote, "/" included, unless what follows the colon is
# a port ("host:5000/path@x" has no user-info).
_USERINFO = (r"(?:(?P<user>[^/\s'\"<>@:]*):(?!\d+(?:[/\s'\"<>?#]|$))(?P<password>[^\s'\"<>]*)"
             r"|(?P<token>[^/\s'\"<>]*))@")
_URL_USERINFO = re.compile(r"\b(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)" + _USERINFO)
# NAME=value (also --name=value, ?name=value): the value runs to a space, quote, & or ;.
_ASSIGNMENT = re.compile(r"(?<![\w.\-])(-{0,2}[A-Za-z_][\w.\-]*)=([^\s'\"&;]+)")
# --name value: an option and its separate value (which does not start with "-").
_OPTION_VALUE = re.compile(r"(?<![\w.\-])(--?[A-Za-z][\w.\-]*)([ \t]+)([^\s'\"\-][^\s'\"]*)")
# "name": "value" / 'name': value (JSON, Python reprs): the value is quoted or runs to , } ].
_QUOTED_KEY = re.compile(r"(?P<q>[\"'])(?P<name>[A-Za-z_][\w.\-]*)(?P=q)(?P<sep>\s*:\s*)"
                         r"(?:(?P<vq>[\"'])(?P<quoted>(?:\\.|(?!(?P=vq))[^\\\n])*)(?P=vq)"
                         r"|(?P<bare>[^\s,}\]\"']+))")
# name: value (YAML, HTTP headers): the value runs to the end of the line, a , } or ].
_BARE_KEY = re.compile(r"(?<![\w.\-\"'/])(?P<name>[A-Za-z_][\w.\-]*)(?P<sep>[ \t]*:[ \t]+)"
                       r"(?P<value>[^\s,}\]\"'][^\n,}\]]*)")
_CAMEL = re.compile(r"([a-z0-9])([A-Z])")


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[^A-Za-z0-9]+", _CAMEL.sub(r"\1_\2", name).upper()) if w]


@lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    """Whether a variable, key or option called ``name`` holds a credential.

    Secret: a word ``SECRET``, ``PASSWORD``/``PASSWD``/``PASS``, ``TOKEN``, ``CREDENTIAL(S)``,
    ``DSN``, ``AUTHORIZATION`` or ``COOKIE`` anywhere (``AWS_SECRET_ACCESS_KEY``,
    ``MLFLOW_TRACKING_TOKEN``, ``SENTRY_DSN``), a last word ``KEY`` (``*_API_KEY``,
    ``*_PRIVATE_KEY``, ``B2_APPLICATION_KEY``, the partner of ``B2_APPLICATION_KEY_ID``),
    ``AUTH`` or ``SIGNATURE`` after another word (a bare ``key=`` or ``signature=`` is far more
    often code than a credential), and ``*PWD`` except the shell's ``PWD``. Not secret: key ids
    (``AWS_ACCESS_KEY_ID``), and names ending in ``PATH``, ``FILE``, ``DIR``, ``MODE``, ``URL``,
    ``URI`` or ``ENABLED`` (``RAY_AUTH_TOKEN_PATH`` names a file; ``TOKEN_URL`` an address), and
    exception names (``NoCredentialsError``: the message after it is shown).
    Case, ``-``, ``.`` and camelCase do not matter (``--api-key``, ``secretAccessKey``).
    """
    words = _words(name.lstrip("-"))
    if not words or (len(words) > 1 and words[-1] in _POINTER_LAST_WORDS | _EXCEPTION_LAST_WORDS):
        return False
    if any(w in _SECRET_WORDS for w in words):
        return True
    if len(words) > 1 and words[-1] in _SECRET_LAST_WORDS:
        return True
    return "PWD" in words and len(words) > 1


def redact_url(uri: str) -> str:
    """``uri`` without user-info and with secret-named query parameters masked.

    ``http://bob:pw@host:5000/x`` -> ``http://host:5000/x``; also without a scheme
    (``bob:pw@host:5000`` -> ``host:5000``), for values that are known to be addresses.
    """
    if "://" in uri:
        return _mask_assignments(_URL_USERINFO.sub(r"\g<scheme>", uri))
    return redact_url(f"x://{uri}").removeprefix("x://")


def quiet_mlflow_urls(tracking_uri: str) -> None:
    """Turn off MLflow's "View run at <url>" print in this process when ``tracking_uri`` carries
    credentials: MLflow's REST client prints the URL, user-info and all, to stdout whenever a run
    ends, and stdout is Ray's job and worker logs. MLflow's own switch
    (``MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT``) is read at each call, so setting it here covers
    every client in the process; URIs without credentials keep MLflow's link."""
    if redact_url(tracking_uri) != tracking_uri:
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"


def _hides(name: str, value: str) -> bool:
    return is_secret_name(name) and not _PLACEHOLDER.fullmatch(value.strip())


def _mask_assignments(text: str) -> str:
    """Rule 2: the values of secret-named assignments, options, keys and headers masked."""
    def assignment(match: re.Match[str]) -> str:
        name, value = match.group(1), match.group(2)
        return f"{name}={MASK}" if _hides(name, value) else match.group(0)

    def option(match: re.Match[str]) -> str:
        name, gap, value = match.groups()
        return f"{name}{gap}{MASK}" if _hides(name, value) else match.group(0)

    def quoted_key(match: re.Match[str]) -> str:
        value = match["quoted"] if match["vq"] else match["bare"]
        if not _hides(match["name"], value):
            return match.group(0)
        quote = match["vq"] or ""
        return f"{match['q']}{match['name']}{match['q']}{match['sep']}{quote}{MASK}{quote}"

    def bare_key(match: re.Match[str]) -> str:
        name, sep, value = match["name"], match["sep"], match["value"]
        return f"{name}{sep}{MASK}" if _hides(name, value) else match.group(0)

    text = _ASSIGNMENT.sub(assignment, text)
    text = _OPTION_VALUE.sub(option, text)
    text = _QUOTED_KEY.sub(quoted_key, text)
    return _BARE_KEY.sub(bare_key, text)


def _userinfo_secrets(value: str) -> Iterable[str]:
    """The credential parts of every URL user-info in ``value`` (password, or a bare token)."""
    for match in _URL_USERINFO.finditer(value):
        secret = match["token"] if match["token"] is not None else match["password"]
        yield from {secret, unquote(secret)}


def secret_values(env: Mapping[str, str] | None = None) -> set[str]:
    """Secret values known to this process: what :func:`redact_text` masks verbatim.

    The values of secret-named variables in ``env`` (default ``os.environ``) and the passwords
    (or bare tokens) of URLs in any of its values, each at least :data:`MIN_SECRET_CHARS` long;
    numbers and switch words (``true``, ``off``, ...) are not secrets.
    """
    env = os.environ if env is None else env
    found: set[str] = set()
    for name, value in env.items():
        if is_secret_name(name) and not _PLACEHOLDER.fullmatch(value):
            found.add(value.strip())
        if "@" in value:
            found.update(_userinfo_secrets(value))
    return {value for value in found
            if len(value) >= MIN_SECRET_CHARS and value.lower() not in _NOT_SECRET_VALUES
            and not value.isdigit()}


def redact_text(text: str, secrets: Iterable[str] | None = None) -> str:
    """``text`` with every rule applied: URL user-info, secret-named assignments, known values.

    Args:
        text: a message, a log line, a command line, a JSON document.
        secrets: values to mask wherever they occur; default :func:`secret_values` of this
            process's environment. Pass ``()`` to apply the first two rules only.
    """
    known = secret_values() if secrets is None else {s for s in secrets
                                                     if len(s) >= MIN_SECRET_CHARS}
    for value in sorted(known, key=len, reverse=True):
        text = text.replace(value, MASK)
    return _mask_assignments(_URL_USERINFO.sub(r"\g<scheme>", text))


def redact_value(name: str, value: str) -> str:
    """How the value of the variable (or key, or option) ``name`` may be shown.

    A secret-named variable's value is :data:`MASK` (empty stays empty, a ``${NAME}``
    reference stays as written); an address (a name ending in ``URL``, ``URI``, ``ENDPOINT``,
    ``ADDRESS``, ``LOCATION``, ``HOST``) goes through :func:`redact_url`; anything else through
    :func:`redact_text`.
    """
    if not value or _PLACEHOLDER.fullmatch(value):
        return value
    if is_secret_name(name):
        return MASK
    words = _words(name)
    if words and words[-1] in _ADDRESS_LAST_WORDS:
        return redact_text(redact_url(value))
    return redact_text(value)


def redact_env(env: Mapping[str, object]) -> dict[str, str]:
    """A copy of ``env`` (variables, a runtime env's ``env_vars``, settings) safe to show."""
    return {str(name): redact_value(str(name), str(value)) for name, value in env.items()}


def redact_command(argv: Sequence[str]) -> str:
    """A command line, shell-quoted, safe to record (e.g. as a run's entrypoint tag).

    ``--password hunter2`` and ``--api-key=...`` are masked, URLs lose their user-info, and known
    secret values are masked wherever they appear.
    """
    secrets = secret_values()
    shown: list[str] = []
    for index, arg in enumerate(argv):
        previous = argv[index - 1] if index else ""
        if previous.startswith("-") and "=" not in previous and is_secret_name(previous):
            shown.append(MASK)
        else:
            shown.append(redact_text(arg, secrets))
    return shlex.join(shown)


class RedactingFilter(logging.Filter):
    """A handler filter that applies :func:`redact_text` to each record, traceback included.

    Attach it to the handlers that write raydeck's logs (the CLI's console, a job's
    ``basicConfig``): a filter on a logger would miss records of its child loggers.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = redact_text(record.getMessage())
        record.args = None
        if record.exc_info:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        return True
