"""raydeck's errors cross processes: every class round-trips through Ray with its message.

Ray pickles an exception raised in a task, an actor or a Ray Train worker and raises it again on
the caller; an error that cannot be rebuilt shows up there as an unrelated ``TypeError`` or
``ValueError`` from inside pickle instead of raydeck's message.
"""

from __future__ import annotations

import inspect
import pickle
from typing import Any

import pytest

import raydeck.errors

# Constructor arguments for classes that do not take a message; every other class is built with
# a message. A new class with another signature fails the coverage test until it is added here.
EXAMPLE_ARGS: dict[type[Exception], tuple[Any, ...]] = {
    raydeck.errors.TrackingValidationError: ({"loss": "must be a number, got 'abc'",
                                              "bad key!": "keys may hold letters, digits"},),
}


def _classes() -> list[type[raydeck.errors.RaydeckError]]:
    return [cls for _, cls in inspect.getmembers(raydeck.errors, inspect.isclass)
            if issubclass(cls, raydeck.errors.RaydeckError)
            and cls.__module__ == raydeck.errors.__name__]


def _example(cls: type[raydeck.errors.RaydeckError]) -> raydeck.errors.RaydeckError:
    args = EXAMPLE_ARGS.get(cls, (f"{cls.__name__}: RAYDECK_X = 'y' must be z; set it to z",))
    return cls(*args)


def _same(original: BaseException, copy: BaseException) -> None:
    assert type(copy) is type(original)
    assert str(copy) == str(original) and str(copy)
    assert vars(copy) == vars(original)


def test_every_error_class_is_covered() -> None:
    classes = _classes()
    assert len(classes) >= 12
    for cls in classes:
        _example(cls)  # a TypeError here: add the class's constructor arguments to EXAMPLE_ARGS


@pytest.mark.parametrize("cls", _classes(), ids=lambda cls: cls.__name__)
def test_pickle_round_trip_keeps_type_message_and_attributes(
        cls: type[raydeck.errors.RaydeckError]) -> None:
    import cloudpickle

    original = _example(cls)
    _same(original, pickle.loads(pickle.dumps(original)))
    _same(original, cloudpickle.loads(cloudpickle.dumps(original)))


@pytest.mark.timeout(180)
def test_every_error_raised_in_a_ray_task_reaches_the_driver_with_its_message(
        ray_cluster: None) -> None:
    import ray

    @ray.remote(max_retries=0)
    def fail(cls: type[Exception], args: tuple[Any, ...]) -> None:
        raise cls(*args)

    classes = _classes()
    refs = [fail.remote(cls, EXAMPLE_ARGS.get(cls, (str(_example(cls)),))) for cls in classes]
    for cls, ref in zip(classes, refs, strict=True):
        expected = _example(cls)
        with pytest.raises(cls) as raised:
            ray.get(ref, timeout=120)
        # Ray re-raises an instance of the original class carrying the original as its cause.
        cause = raised.value.cause  # type: ignore[attr-defined]
        _same(expected, cause)
        assert str(expected) in str(raised.value)
        if cls is raydeck.errors.TrackingValidationError:
            assert raised.value.problems == expected.problems  # type: ignore[attr-defined]
