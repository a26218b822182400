"""The variables every Ray node raydeck starts carries, whatever starts it: the embedded
default's local ``ray.init``, ``raydeck up``, compose and KubeRay (each reads :data:`NODE_ENV`).

``GRPC_ENABLE_FORK_SUPPORT=0``. grpcio (1.85) builds gRPC core with its fork handlers on, and a
Ray process forks while its other threads are inside gRPC: Ray Client's proxy starts a server
process for each session with ``subprocess.Popen`` from one of its gRPC threads. On a busy head
the child crashed in gRPC's post-fork handler (SIGSEGV in a restarted ``event_engine`` thread,
before ``exec``), and the session failed with "Initialization failure from server" ("SpecificServer
startup failed" in ``ray_client_server.err``, an empty log of its own). Seen in the suite once a
day or so; four sessions opened at once on an idle head reproduce it within a few rounds (traced
with ``strace -f`` on the proxy). Every fork in Ray's own processes is followed by ``exec``
(workers, the client's servers, a job's entrypoint, pip), which needs no fork handler: gRPC's
own guidance for that case is this setting. A user's own ``ray start`` can set it the same way
(docs/deployment.md).

``RAY_USAGE_STATS_ENABLED=0``: raydeck's clusters send Ray no usage report.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

GRPC_FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"
USAGE_STATS_ENV = "RAY_USAGE_STATS_ENABLED"

NODE_ENV: Mapping[str, str] = MappingProxyType({GRPC_FORK_SUPPORT_ENV: "0", USAGE_STATS_ENV: "0"})


def local_env(environ: Mapping[str, str]) -> dict[str, str]:
    """:data:`NODE_ENV` for a Ray that raydeck starts on this machine: a non-empty value the
    user set in ``environ`` wins for each."""
    return {name: environ.get(name) or value for name, value in NODE_ENV.items()}


# What Ray Client's server says when the server process of a session died as it started.
_CLIENT_SERVER_START_FAILED = "Starting Ray client server failed"


def explain_client_failure(reason: str) -> str:
    """``reason`` (why a Ray Client session failed) with the fix when it is the crash above."""
    if _CLIENT_SERVER_START_FAILED not in reason:
        return reason
    return (f"{reason} (on a busy head this is a crash in gRPC's fork handler: start every Ray "
            f"node with {GRPC_FORK_SUPPORT_ENV}=0, docs/deployment.md)")
