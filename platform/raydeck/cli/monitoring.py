"""``raydeck monitoring config``: the Prometheus configuration that scrapes Ray and raydeck."""

from __future__ import annotations

from pathlib import Path

import typer

from raydeck.cli._console import console, err_console

app = typer.Typer(help="Prometheus for raydeck: scrape every Ray node, load the alert rules.",
                  no_args_is_help=True)

DEFAULT_RULES = Path("dashboards/alerts/raydeck.rules.yml")  # here, else raydeck's copy


@app.command("config")
def config(
    output: Path = typer.Option(Path("prometheus.yml"), "--output", "-o",
                                help="Where to write it; '-' prints it."),
    discovery_file: Path = typer.Option(
        None, "--discovery-file", show_default=False,
        help="Ray's service-discovery file (default: <ray temp dir>/session_latest/"
             "prom_metrics_service_discovery.json)."),
    rules: list[Path] = typer.Option(
        [], "--rules", help=f"Alert rule file(s) to load (default: {DEFAULT_RULES} in this "
                            "directory if it exists, else the copy installed with raydeck)."),
    local: bool = typer.Option(True, "--local/--cluster",
                               help="Scrape 127.0.0.1 (one machine) or each node's address."),
    cluster_name: str = typer.Option("", "--cluster-name",
                                     help="ray_io_cluster label for every series."),
    scrape_interval: float = typer.Option(15.0, min=1, help="Seconds between scrapes."),
    evaluation_interval: float = typer.Option(15.0, min=1,
                                              help="Seconds between rule evaluations."),
) -> None:
    """Write a Prometheus config that scrapes every Ray node and loads raydeck's alert rules."""
    from raydeck.config.package_data import checkout_path, packaged_path
    from raydeck.errors import ConfigError
    from raydeck.observability.prometheus import PrometheusConfig, default_discovery_file

    discovery = discovery_file or default_discovery_file()
    if not rules:
        found = (DEFAULT_RULES if DEFAULT_RULES.is_file() else
                 packaged_path(DEFAULT_RULES) or checkout_path(DEFAULT_RULES))
        rules = [found] if found is not None else []
    missing = [str(path) for path in rules if not path.is_file()]
    if missing:
        raise ConfigError(f"--rules {', '.join(missing)}: no such file (raydeck's rendered rules "
                          f"are {DEFAULT_RULES}, installed with raydeck)")
    prometheus = PrometheusConfig(discovery_file=discovery, rule_files=tuple(rules), local=local,
                                  cluster=cluster_name, scrape_interval_s=scrape_interval,
                                  evaluation_interval_s=evaluation_interval)
    if str(output) == "-":
        typer.echo(prometheus.render(), nl=False)
        return
    prometheus.write(output)
    console.print(f"wrote {output}: scrapes the Ray nodes listed in {discovery}"
                  f"{' on 127.0.0.1' if local else ''}, loads {len(rules)} rule file(s)",
                  soft_wrap=True)
    if not rules:
        err_console.print(f"[yellow]no alert rules loaded: {DEFAULT_RULES} not found here or "
                          "in this raydeck install[/]")
    if not discovery.exists():
        err_console.print(f"[yellow]{discovery} does not exist yet: Ray writes it while its "
                          "dashboard runs (`ray start --head`); Prometheus reads it once it "
                          "appears[/]", soft_wrap=True)
    console.print(f"start Prometheus: prometheus --config.file={output}", soft_wrap=True)
