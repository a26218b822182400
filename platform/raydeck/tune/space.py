"""Search spaces: what a sweep varies, parsed from a dict or YAML and validated up front.

Owns: the dimensions of a space (a distribution per searched name, nested groups included), the
constants every trial gets, turning both into Tune's ``param_space``, and the plain-data view of
a trial's config that MLflow params, tags and JSON can hold. Does not own: how points are drawn
(the search algorithm, seeded in :mod:`raydeck.tune.scheduling`).

Any value Tune accepts survives: lists, tuples, nested dicts and ``None`` as choices or grid
points (``layers: {choice: [[64], [128, 64]]}``), nested groups of parameters
(``optimizer: {lr: {loguniform: [1e-4, 1e-1]}, name: adam}``) and, from Python, Tune's own
domain objects (``tune.choice(...)``, ``tune.grid_search(...)``).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raydeck.errors import ConfigError

DISTRIBUTIONS = ("choice", "uniform", "loguniform", "randint", "grid")
# tune.grid_search(values) returns {"grid_search": values}; accept it as "grid".
_ALIASES = {"grid_search": "grid"}
# A searched or fixed name nested in groups is shown as its path joined by dots.
PATH_SEPARATOR = "."


@dataclass(frozen=True)
class Dimension:
    """One searched hyperparameter: a distribution and its arguments, validated.

    ``path`` places it in the trial's config (``("optimizer", "lr")`` is
    ``config["optimizer"]["lr"]``). ``kind="tune"`` holds a Tune domain object given from Python
    (``values`` is that one object), passed to Tune unchanged.
    """

    path: tuple[str, ...]
    kind: str
    values: tuple[Any, ...]

    def __post_init__(self) -> None:
        where = f"search space {self.name!r}"
        if self.kind == "tune":
            return
        if self.kind not in DISTRIBUTIONS:
            raise ConfigError(
                f"{where}: unknown distribution {self.kind!r}; use one of "
                f"{', '.join(DISTRIBUTIONS)} (a group of parameters maps names to "
                "distributions or constants)"
            )
        if self.kind in ("choice", "grid"):
            if not self.values:
                raise ConfigError(f"{where}: {self.kind} needs at least one value, got []")
            return
        if len(self.values) != 2:
            raise ConfigError(f"{where}: {self.kind} needs [low, high], got {list(self.values)}")
        low, high = self.values
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)):
            raise ConfigError(f"{where}: {self.kind} bounds must be numbers, got {[low, high]}")
        if not low < high:
            raise ConfigError(f"{where}: {self.kind} needs low < high, got {[low, high]}")
        if self.kind == "loguniform" and low <= 0:
            raise ConfigError(f"{where}: loguniform needs low > 0, got {low}")
        if self.kind == "randint" and not (float(low).is_integer() and float(high).is_integer()):
            raise ConfigError(f"{where}: randint bounds must be integers, got {[low, high]}")

    @property
    def name(self) -> str:
        return PATH_SEPARATOR.join(self.path)

    @property
    def continuous(self) -> bool:
        """A real-valued range: what population-based training may perturb by default."""
        return self.kind in ("uniform", "loguniform")

    def to_tune(self) -> Any:
        from ray import tune

        if self.kind == "tune":
            return self.values[0]
        if self.kind == "choice":
            return tune.choice(list(self.values))
        if self.kind == "grid":
            return tune.grid_search(list(self.values))
        low, high = self.values
        if self.kind == "uniform":
            return tune.uniform(low, high)
        if self.kind == "loguniform":
            return tune.loguniform(low, high)
        return tune.randint(int(low), int(high))

    def describe(self) -> str:
        if self.kind == "tune":
            domain = self.values[0]
            return f"{type(domain).__name__}{getattr(domain, 'domain_str', '')}"
        return f"{self.kind}({', '.join(json.dumps(plain(v)) for v in self.values)})"


@dataclass(frozen=True)
class SearchSpace:
    """Hyperparameters to search (``dimensions``) and fixed values passed to every trial.

    ``constants`` maps names to values; a nested group of constants is a nested mapping.
    """

    dimensions: tuple[Dimension, ...]
    constants: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> SearchSpace:
        """Parse ``{"lr": {"loguniform": [1e-4, 1e-1]}, "hidden": {"choice": [64, 128]}, ...}``.

        A one-key mapping naming a distribution is a dimension; another mapping is a group of
        parameters (parsed the same way, nested in the trial's config); a Tune domain object is
        a dimension as it is; anything else is a constant.

        Raises:
            ConfigError: unknown distribution, empty choice list, bad bounds (named), or a
                space with nothing to search.
        """
        dimensions: list[Dimension] = []
        constants = _parse(spec, (), dimensions)
        if not dimensions:
            raise ConfigError("search space: nothing to search (no distribution given)")
        return cls(tuple(dimensions), constants)

    @classmethod
    def from_yaml(cls, path: str | Path) -> SearchSpace:
        import yaml

        try:
            spec = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"search space file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"search space file {path}: not valid YAML ({exc})") from None
        if not isinstance(spec, Mapping):
            raise ConfigError(f"search space file {path}: expected a mapping of name -> spec")
        return cls.from_dict(spec)

    def to_tune(self) -> dict[str, Any]:
        """Tune's ``param_space``: the constants with every dimension placed at its path."""
        space: dict[str, Any] = copy.deepcopy(dict(self.constants))
        for dimension in self.dimensions:
            group = space
            for part in dimension.path[:-1]:
                group = group.setdefault(part, {})
            group[dimension.path[-1]] = dimension.to_tune()
        return space

    def describe(self) -> dict[str, str]:
        return {d.name: d.describe() for d in self.dimensions}

    def dimension(self, name: str) -> Dimension:
        """The dimension called ``name`` (dotted for nested ones).

        Raises:
            ConfigError: no such dimension (the message lists the known ones).
        """
        for candidate in self.dimensions:
            if candidate.name == name:
                return candidate
        raise ConfigError(f"search space has no dimension {name!r}; it has "
                          f"{', '.join(d.name for d in self.dimensions)}")


def _parse(spec: Mapping[str, Any], prefix: tuple[str, ...], dimensions: list[Dimension]
           ) -> dict[str, Any]:
    """Collect the dimensions of ``spec`` into ``dimensions``; returns its constants."""
    from ray.tune.search.sample import Domain

    constants: dict[str, Any] = {}
    for raw_name, value in spec.items():
        path = (*prefix, str(raw_name))
        name = PATH_SEPARATOR.join(path)
        if isinstance(value, Domain):
            dimensions.append(Dimension(path, "tune", (value,)))
        elif isinstance(value, Mapping):
            if not value:
                raise ConfigError(f"search space {name!r}: empty mapping; give a distribution "
                                  "such as {choice: [...]} or a group of parameters")
            if len(value) == 1 and _names_a_distribution(value):
                ((kind, args),) = value.items()
                values = tuple(args) if isinstance(args, (list, tuple)) else (args,)
                dimensions.append(Dimension(path, _ALIASES.get(str(kind), str(kind)), values))
            else:
                group = _parse(value, path, dimensions)
                if group:
                    constants[str(raw_name)] = group
        else:
            constants[str(raw_name)] = value
    return constants


def _names_a_distribution(value: Mapping[str, Any]) -> bool:
    """A one-key mapping is a distribution if its key is one, or if it looks like one: a list
    of arguments under an unknown name is a typo (``lognormal: [...]``), not a group."""
    ((kind, args),) = value.items()
    return str(kind) in DISTRIBUTIONS or str(kind) in _ALIASES or isinstance(args, (list, tuple))


def plain(value: Any) -> Any:
    """``value`` as plain JSON data: numpy scalars to Python, tuples to lists, recursively."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    item = getattr(value, "item", None)
    if callable(item) and type(value).__module__ == "numpy":
        return item()
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested groups of a trial's config as dotted names: ``{"opt": {"lr": 1}}`` ->
    ``{"opt.lr": 1}``. Values are plain data (see :func:`plain`); lists stay lists."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}{PATH_SEPARATOR}"))
        else:
            flat[name] = plain(value)
    return flat


def is_scalar(value: Any) -> bool:
    """Whether an MLflow tag can hold ``value`` as it is (``None`` is written ``null``)."""
    return value is None or isinstance(value, (str, int, float, bool))


def as_text(value: Any) -> str:
    """How a config value is written as an MLflow param or tag: strings as they are, numbers
    and booleans as Python prints them, everything else (``None``, lists) as JSON."""
    value = plain(value)
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, int, float)):
        return str(value)
    return json.dumps(value)
