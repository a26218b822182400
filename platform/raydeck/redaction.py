"""Placeholder until the redaction module lands: strip URL user-info from text."""

from __future__ import annotations

import re

_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][\w+.\-]*://)[^/@\s]+@")


def redact_text(text: str) -> str:
    return _USERINFO.sub(r"\g<scheme>", text)
