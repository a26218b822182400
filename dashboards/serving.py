"""Serving: traffic, latency, errors and queues of `raydeck serve` applications, per replica,
and which model version each replica answers with.

Reads Ray Serve's own metrics (``ray_serve_*``, exported by every proxy and replica) and the
replicas' raydeck metrics (raydeck.observability.metrics, ``SERVING_*``). Rendered to
grafana/raydeck-serving.json.
"""

from raydeck.observability.dashboards import (
    CLUSTER,
    CLUSTER_FILTER,
    Dashboard,
    Panel,
    Row,
    Target,
    Threshold,
    Variable,
    quantile_target,
    selector,
)
from raydeck.observability.metrics import (
    SERVING_BAD_REQUESTS,
    SERVING_MODEL_UPDATES,
    SERVING_MODEL_VERSION,
)

APPLICATION = Variable(
    "application", "Application",
    f'label_values(ray_serve_num_http_requests_total{{{CLUSTER_FILTER}}}, application)',
    "Serve application (`raydeck serve --name`, by default the model's name)")
SERVE_FILTERS = (CLUSTER_FILTER, 'application=~"$application"')
REQUESTS = "ray_serve_num_http_requests_total"
SERVER_ERROR = 'status_code=~"5.."'
APP_FILTERS = (CLUSTER_FILTER, 'app=~"$application"')


def _rate(metric: str, by: str, *matchers: str) -> str:
    return (f"sum by ({by}) (rate({selector(metric, *SERVE_FILTERS, *matchers)}"
            "[$__rate_interval]))")


def _quantile(metric: str, quantile: float, by: str) -> Target:
    return quantile_target(metric, quantile, SERVE_FILTERS, by=by)


traffic_row = Row("Traffic", (
    Panel("Requests per second", (Target(
        _rate(REQUESTS, "application, status_code"),
        "{{application}} {{status_code}}"),), unit="reqps", stack=True,
        description="HTTP requests through Serve's proxies, by status code; 400 is bad input "
                    "(the message names the problem), 5xx a server fault."),
    Panel("Latency p50 / p99", (
        _quantile("ray_serve_http_request_latency_ms", 0.5, "application"),
        _quantile("ray_serve_http_request_latency_ms", 0.99, "application"),
    ), unit="ms", description="End-to-end latency at the proxy, batching wait included."),
    Panel("Server errors", (Target(
        # Serve exports no zero: `or 0 * all requests` draws 0 for an application without 5xx.
        f"sum by (application) (increase("
        f"{selector(REQUESTS, *SERVE_FILTERS, SERVER_ERROR)}[$__rate_interval]))"
        f" or 0 * sum by (application) (increase({selector(REQUESTS, *SERVE_FILTERS)}"
        "[$__rate_interval]))", "{{application}}"),), thresholds=(Threshold(1, "red"),),
        description="5xx answers: a replica failed on a valid request. Bad input is a 400 "
                    "and counted separately, never here."),
    Panel("Bad requests (400)", (Target(
        f"sum by (app) (rate({selector(SERVING_BAD_REQUESTS, *APP_FILTERS)}"
        "[$__rate_interval]))", "{{app}}"),), unit="reqps",
        description="Requests refused as malformed: not JSON, wrong width or dtype, too "
                    "large. Clients need fixing, not the server."),
))

replicas_row = Row("Replicas and queues", (
    Panel("Queued requests", (Target(
        f"sum by (application, deployment) "
        f"({selector('ray_serve_deployment_queued_queries', *SERVE_FILTERS)})",
        "{{application}} {{deployment}}"),),
        description="Requests waiting for a replica: growing means too few replicas (raise "
                    "the preset's count or --autoscale's maximum)."),
    Panel("In flight per replica", (Target(
        f"sum by (replica) "
        f"({selector('ray_serve_replica_processing_queries', *SERVE_FILTERS)})",
        "{{replica}}"),), description="Requests each replica is working on (batched ones "
                                      "included)."),
    Panel("Replica latency p99", (
        _quantile("ray_serve_deployment_processing_latency_ms", 0.99, "replica"),),
        unit="ms", description="Time inside each replica: parsing, the batch wait and the "
                               "model."),
    Panel("Healthy replicas", (Target(
        f"sum by (application) "
        f"({selector('ray_serve_deployment_replica_healthy', *SERVE_FILTERS)})",
        "{{application}}"),), kind="stat", width=6,
        description="Replicas passing Serve's health check."),
    Panel("Model version per replica", (Target(
        f"max by (app, model, WorkerId) ({selector(SERVING_MODEL_VERSION, *APP_FILTERS)})",
        "{{app}} {{WorkerId}}"),), width=9,
        description="Registry version each replica answers with; after an alias moves, all "
                    "replicas reach the new version within the poll interval."),
    Panel("Model updates", (Target(
        f"sum by (app, outcome) (increase({selector(SERVING_MODEL_UPDATES, *APP_FILTERS)}"
        "[$__rate_interval]))", "{{app}} {{outcome}}"),), width=9,
        description="switched: a replica moved to the alias' new version; rejected: the new "
                    "version failed its health check and the replica kept the old one (see "
                    "`raydeck serve status`)."),
))

DASHBOARD = Dashboard(
    uid="raydeck-serving",
    title="raydeck / Serving",
    description="Requests, latency, errors, queues and model versions of raydeck serve.",
    variables=(CLUSTER, APPLICATION),
    rows=(traffic_row, replicas_row),
)
