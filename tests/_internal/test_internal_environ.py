"""raydeck._internal.environ: variables set for a block, then put back."""

from __future__ import annotations

import os

import pytest

from raydeck._internal.environ import environment

pytestmark = pytest.mark.timeout(30)


def test_each_variable_is_as_it_was_after_the_block_also_when_it_raised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RD_TEST_SET", "before")
    monkeypatch.delenv("RD_TEST_UNSET", raising=False)
    with pytest.raises(RuntimeError), environment({"RD_TEST_SET": "in", "RD_TEST_UNSET": "in"}):
        assert os.environ["RD_TEST_SET"] == os.environ["RD_TEST_UNSET"] == "in"
        raise RuntimeError("the block failed")
    assert os.environ["RD_TEST_SET"] == "before"
    assert "RD_TEST_UNSET" not in os.environ
