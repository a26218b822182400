"""`raydeck serve`'s options without a cluster: presets become replicas and resources, and every
bad option is one line and exit 2 before anything touches Ray or MLflow."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from raydeck.config.settings import load_settings
from raydeck.errors import ConfigError
from raydeck.serving import ServeOptions


def test_gpu_quarter_packs_four_replicas_on_one_gpu() -> None:
    options = ServeOptions("models:/digits@champion", preset="gpu-quarter")
    deployment = options.deployment_options(load_settings())
    assert deployment["num_replicas"] == 4
    assert deployment["ray_actor_options"] == {
        "num_cpus": 1, "num_gpus": 0.25,
        "runtime_env": {"env_vars": {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"}}}
    assert deployment["user_config"] == {"max_batch_size": 32, "batch_wait_timeout_s": 0.0}
    assert options.name == "digits" and options.follows_alias


def test_autoscaling_replaces_the_fixed_count_and_starts_at_the_presets() -> None:
    options = ServeOptions("models:/digits/3", preset="cpu-2", min_replicas=1, max_replicas=4,
                           target_ongoing_requests=4)
    deployment = options.deployment_options(load_settings())
    assert "num_replicas" not in deployment
    assert deployment["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
        "target_ongoing_requests": 4}
    assert not options.follows_alias


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"max_batch_size": 0}, "--max-batch-size"),
    ({"max_batch_size": 128}, "--max-ongoing-requests"),
    ({"min_replicas": 2}, "--autoscale"),
    ({"min_replicas": 3, "max_replicas": 2}, "--autoscale"),
    ({"poll_interval_s": 0}, "--poll-interval"),
    ({"route_prefix": "digits"}, "--route-prefix"),
    ({"name": "has space"}, "--name"),
    ({"port": 0}, "--port"),
])
def test_bad_options_name_the_option(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        ServeOptions("models:/digits@champion", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("args", [
    ["serve", "models:/digits@champion", "--autoscale", "four"],
    ["serve", "models:/digits@champion", "--preset", "no-such-preset", "--config-out", "x.yaml"],
    ["serve"],
])
def test_the_cli_answers_bad_options_with_one_line_and_exit_2(args: list[str]) -> None:
    from raydeck.cli.main import app

    answer = CliRunner().invoke(app, args)
    assert answer.exit_code != 0
    assert isinstance(answer.exception, ConfigError) or answer.exit_code == 2, answer.output
