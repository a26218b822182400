"""The rules raydeck's integrations use instead of raising: every key comes out MLflow-legal,
every change says why, nothing is dropped without a record (raydeck.tracking.client.validation)."""

from __future__ import annotations

import math
import random
import string

import pytest
import torch

from raydeck.tracking.client.validation import (
    Sanitized,
    key_problem,
    legal_key,
    sanitize_metrics,
    sanitize_params,
    truncated_param,
)


@pytest.mark.parametrize(("key", "legal"), [
    ("recall@5", "recall5"),                    # as Lightning's MLFlowLogger
    ("val/acc(top-1)", "val/acctop-1"),
    ("a//b/./c/", "a/b/c"),
    ("/abs/../x", "abs/x"),
    ("..hidden", "hidden"),
    ("ratio:train", "ratio:train"),             # MLflow allows ':' (MLFlowLogger removes it)
    ("échelle", "échelle"),
    (5, "5"),
    ("@@", None),
    ("..", None),
])
def test_keys_become_what_mlflow_accepts(key: object, legal: str | None) -> None:
    new, reason = legal_key(key)
    assert new == legal
    assert (reason is None) == (new == key)


def test_long_keys_are_cut_and_stay_distinct() -> None:
    first, reason = legal_key("layer/" + "x" * 300 + "/a")
    second, _ = legal_key("layer/" + "x" * 300 + "/b")
    assert first and second and first != second
    assert len(first) == len(second) == 250 and key_problem(first) is None
    assert reason == "cut to 250 characters (was 308)"


def test_any_key_comes_out_legal_or_dropped_with_a_reason() -> None:
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits + "/.@ :-_()#é\\"
    for _ in range(5000):
        key = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))
        new, reason = legal_key(key)
        if new is None:
            assert reason, key
        else:
            assert key_problem(new) is None, key


def test_long_params_are_cut_with_a_reason() -> None:
    assert truncated_param(0.1) == ("0.1", None)
    text, reason = truncated_param("z" * 10_000)
    assert text == "z" * 6000
    assert reason == "param values may be at most 6000 characters; cut from 10000"


def test_metrics_keep_numbers_and_record_every_change() -> None:
    values, changes = sanitize_metrics({
        "loss": 0.5, "recall@5": torch.tensor(0.25), "recall5": 1.0, "flag": True,
        "note": "text", "vector": torch.ones(3), "diverged": float("nan"),
    })
    assert set(values) == {"loss", "recall5", "flag", "diverged"}
    assert values["recall5"] == 0.25 and values["flag"] == 1.0 and math.isnan(values["diverged"])
    by_key = {change.key: change for change in changes}
    assert set(by_key) == {"recall@5", "recall5", "note", "vector"}
    assert by_key["recall@5"].logged_as == "recall5" and not by_key["recall@5"].dropped
    assert by_key["recall5"] == Sanitized("recall5", None,
                                          "another key of the same call is logged as 'recall5'")
    assert by_key["note"].reason == "metric values must be numbers, got str"
    assert by_key["vector"].dropped


def test_params_are_text_with_legal_keys() -> None:
    params, changes = sanitize_params({"lr": 0.1, "model/name": None, "prompt@v2": "p" * 7000})
    assert params == {"lr": "0.1", "model/name": "None", "promptv2": "p" * 6000}
    assert [(c.key, c.logged_as) for c in changes] == [("prompt@v2", "promptv2")]
    assert "removed '@'" in changes[0].reason and "cut from 7000" in changes[0].reason
