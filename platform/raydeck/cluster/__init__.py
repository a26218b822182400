"""The Ray cluster raydeck runs on: connecting to it, and the nodes raydeck starts.

- :mod:`~raydeck.cluster.connection`: :func:`connect` (an existing cluster, or a local Ray with
  raydeck's settings in its processes' environment), :func:`connect_running`, :func:`nodes`,
  and the runtime env every raydeck job carries.
- :mod:`~raydeck.cluster.node_env`: the variables every Ray node raydeck starts carries (gRPC's
  fork handlers off, no usage stats), wherever it starts it.
- :mod:`~raydeck.cluster.serve_ingress`: the variables every Ray node raydeck starts carries for
  Ray Serve's HTTP ingress (HAProxy). Ray reads them when a node starts, never when an
  application deploys, so they belong to the nodes (local ``ray.init``, ``raydeck up``, compose,
  KubeRay) rather than to :mod:`raydeck.serving`, and every process that may start a local Ray
  (a training driver included) reads them without importing Serve.
"""

from raydeck.cluster.connection import NodeView, connect, connect_running, nodes

__all__ = ["NodeView", "connect", "connect_running", "nodes"]
