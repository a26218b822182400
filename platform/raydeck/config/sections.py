"""What a section of raydeck's settings is: fields that map to variables and raydeck.toml keys.

Owns: :func:`setting` (declaring one setting: its default and the line of documentation README
shows), :class:`Section` (the mixin that gives a frozen settings dataclass its ``RAYDECK_*``
variable prefix, its raydeck.toml table and the error naming both), and converting between a
field's type and what a variable or a TOML key holds (:func:`build_section`,
:func:`format_value`). Does not own: which settings exist, their validation, or where and in
which order they are read (:mod:`raydeck.config.settings`).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import field
from pathlib import Path
from typing import Any, ClassVar

from raydeck._internal.redaction import redact_value
from raydeck.config.secrets import Secret
from raydeck.errors import ConfigError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def setting(default: Any, doc: str) -> Any:
    """Declare one setting: its default and the line of documentation README shows."""
    return field(default=default, metadata={"doc": doc})


class Section:
    """Mixin giving each settings section its variable prefix and TOML table."""

    ENV_PREFIX: ClassVar[str] = "RAYDECK_"
    TOML_TABLE: ClassVar[str] = ""

    @classmethod
    def env_name(cls, name: str) -> str:
        return f"{cls.ENV_PREFIX}{name.upper()}"

    @classmethod
    def toml_key(cls, name: str) -> str:
        return f"[{cls.TOML_TABLE}].{name}" if cls.TOML_TABLE else name

    def _reject(self, name: str, rule: str) -> ConfigError:
        value = getattr(self, name)
        shown = ("<secret>" if isinstance(value, Secret)
                 else _shown(self.env_name(name), value))
        return ConfigError(
            f"{self.env_name(name)} (raydeck.toml {self.toml_key(name)}) = {shown!r}: {rule}"
        )


def format_value(value: Any) -> str:
    """``value`` as a ``RAYDECK_*`` variable holds it (booleans as ``true``/``false``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _shown(variable: str, value: Any) -> Any:
    """``value`` of ``variable`` as an error may quote it: strings redacted, others as they are."""
    return redact_value(variable, value) if isinstance(value, str) else value


def _parse(section: type[Section], name: str, annotation: Any, raw: Any) -> Any:
    """Convert an env string or TOML value to the field's type, or raise naming the field."""
    shown = _shown(section.env_name(name), raw)
    where = f"{section.env_name(name)} (raydeck.toml {section.toml_key(name)}) = {shown!r}"
    target = annotation
    try:
        if target is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError
        if target is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError
            return int(raw)
        if target is float:
            if isinstance(raw, bool):
                raise ValueError
            return float(raw)
        if target is Path:
            return Path(str(raw))
        if target is Secret:
            return Secret(str(raw))
        return str(raw)
    except ValueError:
        kind = {bool: "true or false", int: "an integer", float: "a number"}.get(target, "text")
        if target is Secret:
            where = f"{section.env_name(name)} (raydeck.toml {section.toml_key(name)})"
        raise ConfigError(f"{where}: must be {kind}") from None


def build_section(
    section: type[Section], env: Mapping[str, str], table: Mapping[str, Any], nested: dict
) -> Any:
    """``section`` built from its variables in ``env`` over its raydeck.toml ``table``, with the
    already built sub-sections ``nested`` (by field name); unset fields keep their defaults.

    Raises:
        ConfigError: ``table`` has a key ``section`` does not declare, or a value does not parse.
    """
    known = {f.name for f in dataclasses.fields(section)}  # type: ignore[arg-type]
    unknown = sorted(set(table) - known - set(nested))
    if unknown:
        raise ConfigError(
            f"raydeck.toml: unknown key(s) {', '.join(unknown)} in "
            f"{('[' + section.TOML_TABLE + ']') if section.TOML_TABLE else 'the top level'}; "
            f"known: {', '.join(sorted(known))}"
        )
    hints = typing.get_type_hints(section)
    values: dict[str, Any] = dict(nested)
    for f in dataclasses.fields(section):  # type: ignore[arg-type]
        if f.name in nested:
            continue
        var = section.env_name(f.name)
        if var in env:
            values[f.name] = _parse(section, f.name, hints[f.name], env[var])
        elif f.name in table:
            values[f.name] = _parse(section, f.name, hints[f.name], table[f.name])
    return section(**values)
