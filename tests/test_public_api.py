"""The public surface: every name in raydeck.__all__ resolves, and importing raydeck stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_every_public_name_resolves() -> None:
    import raydeck

    for name in raydeck.__all__:
        assert getattr(raydeck, name) is not None, name


@pytest.mark.timeout(60)
def test_import_raydeck_does_not_import_torch_or_tune() -> None:
    code = ("import sys, raydeck; "
            "print(sorted(m for m in ('torch', 'ray.tune', 'pytorch_lightning') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == "[]"


def test_the_no_op_tracker_overrides_every_call_that_would_reach_the_proxy() -> None:
    from raydeck.tracking import NoOpTracker, Tracker

    # Every public method a tracker has, its mixins' too (StepPolicy's log_metric has a path
    # of its own to the buffer).
    methods = {name for cls in Tracker.__mro__[:-1] for name, v in vars(cls).items()
               if callable(v) and not name.startswith("_") and not isinstance(v, property)}
    kept = {"run_config"}  # builds a RunConfig from the binding; never touches the proxy
    # Asks the job queue, never the proxy: a rank that tracks nothing is preempted like others.
    kept.add("should_preempt")
    # MLflow's singular and file-writing spellings only call overridden methods (log_params,
    # set_tags, _log_file_as), so the no-op needs no copy of them; log_metric has its own path.
    kept |= {"log_param", "set_tag", "log_dict", "log_text", "log_figure", "log_image"}
    assert {"_log_file_as", "log_metric"} <= set(vars(NoOpTracker))
    missing = sorted(m for m in methods - kept if m not in vars(NoOpTracker))
    assert not missing, f"NoOpTracker inherits proxy calls: {missing}"
    tracker = NoOpTracker()
    tracker.log_metrics({"x": 1.0})
    tracker.log_params({"a": 1})
    tracker.log_metric("y", 2.0)
    tracker.log_dict({"k": 1}, "d.json")
    tracker.log_text("t", "t.txt")
    assert tracker.finish().landed and not tracker.active


@pytest.mark.timeout(120)
def test_public_submodules_are_attributes_after_a_plain_import() -> None:
    # README writes `raydeck.tune.sweep(...)` and the notebooks `raydeck.cluster.connect` after
    # `import raydeck`.
    code = ("import sys, raydeck\n"
            "print(sorted(m for m in ('torch', 'ray.tune', 'pytorch_lightning') "
            "if m in sys.modules))\n"
            "assert callable(raydeck.train.checkpointing.restore)\n"
            "assert callable(raydeck.tune.sweep)\n"
            "assert callable(raydeck.cluster.connect)\n"
            "assert raydeck.jobs.JobServer and raydeck.config.Settings\n"
            "assert raydeck.integrations.lightning.RaydeckLogger\n"
            "assert raydeck.observability.metrics.metrics_markdown\n"
            "assert raydeck.examples.digits.run_digits\n"
            "assert {'train', 'tracking', 'serving', 'scheduling'} <= set(dir(raydeck))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[0] == "[]", "import raydeck alone must stay light"


# Every package whose names users import (README, docs, notebooks, jobs/), with its __all__.
PUBLIC_PACKAGES = ("raydeck", "raydeck.cluster", "raydeck.config", "raydeck.jobs",
                   "raydeck.scheduling", "raydeck.serving", "raydeck.tracking", "raydeck.tune")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("package", PUBLIC_PACKAGES)
def test_every_public_name_of_every_public_package_imports(package: str) -> None:
    """``from <package> import <name>`` for each name of its ``__all__``, in a fresh process."""
    code = (f"import importlib; package = importlib.import_module({package!r})\n"
            "names = package.__all__\n"
            "assert names, 'no __all__'\n"
            f"exec('from {package} import ' + ', '.join(names))\n"
            "print(len(names))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.strip()) > 0


def test_every_module_of_the_package_is_listed_as_public_or_private() -> None:
    import importlib
    import pkgutil

    import raydeck

    internal = {"cli", "_internal", "_version"}  # the command, helpers, the version string
    for package in (raydeck, raydeck.integrations, raydeck.observability, raydeck.examples,
                    raydeck.train):
        found = {m.name for m in pkgutil.iter_modules(package.__path__)} - internal
        for name in found:
            module = getattr(package, name)
            assert module is importlib.import_module(f"{package.__name__}.{name}")
        assert found <= set(dir(package)), f"{package.__name__}: list new submodules"
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        _ = raydeck.nope
