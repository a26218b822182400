"""raydeck's settings and everything they are read from, for every raydeck process.

- :mod:`~raydeck.config.settings`: :class:`Settings` and :func:`load_settings` (defaults, the
  settings file, ``RAYDECK_*`` variables; what ``raydeck config`` shows).
- :mod:`~raydeck.config.sections`: how one section of settings is declared, parsed and shown.
- :mod:`~raydeck.config.tracking_uri`: ``raydeck://`` and ``raydeck+<backend>`` tracking URIs.
- :mod:`~raydeck.config.stack_connection`: the file through which every process on the machine
  finds a running ``raydeck up`` stack; :mod:`~raydeck.config.stack_credentials`: its secrets.
- :mod:`~raydeck.config.secrets`: :class:`~raydeck.config.secrets.Secret`, a credential that
  never shows.
- :mod:`~raydeck.config.package_data`: the default files raydeck ships (runtime envs, the sweep
  job, dashboards), found in the wheel or the checkout.

Below every package but ``errors`` and ``_internal``: anything may read settings.
"""

from raydeck.config.settings import Settings, load_settings

__all__ = ["Settings", "load_settings"]
