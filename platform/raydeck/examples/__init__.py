"""Reference training jobs that ship with raydeck (data included, nothing to download)."""

from raydeck._internal.lazy import lazy_attributes

__getattr__, __dir__ = lazy_attributes(__name__, ("digits", "digits_lightning"))
