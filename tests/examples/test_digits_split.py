"""The digits split every job, worker and test uses: scikit-learn's, computed once per machine
and read from a cache afterwards, so a Ray Train worker does not import scikit-learn."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from raydeck.examples import digits

READ_IN_A_FRESH_PROCESS = (
    "import sys\n"
    "import numpy as np\n"
    "from raydeck.examples.digits import raw_split\n"
    "np.savez(sys.argv[1], *raw_split(int(sys.argv[2])))\n"
    "print('sklearn' in sys.modules)\n"
)


@pytest.mark.timeout(120)
def test_a_cached_split_is_scikit_learns_and_is_read_without_importing_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    computed = digits.raw_split(3)
    cache = digits.split_cache_path(3)
    assert cache.is_relative_to(tmp_path / "cache" / "raydeck") and cache.exists()

    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x_train, x_val, y_train, y_val = train_test_split(
        data.data, data.target, test_size=digits.VAL_FRACTION, random_state=3,
        stratify=data.target)
    for got, expected in zip(computed, (x_train, y_train, x_val, y_val), strict=True):
        np.testing.assert_array_equal(got, expected)

    out = tmp_path / "read.npz"
    result = subprocess.run([sys.executable, "-c", READ_IN_A_FRESH_PROCESS, str(out), "3"],
                            env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
                            capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"  # read from the cache: scikit-learn not imported
    with np.load(out) as read:
        for index, expected in enumerate(computed):
            np.testing.assert_array_equal(read[f"arr_{index}"], expected)
            assert read[f"arr_{index}"].dtype == expected.dtype


@pytest.mark.timeout(60)
def test_a_torn_cache_file_is_computed_again(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = digits.split_cache_path(0)
    cache.parent.mkdir(parents=True)
    cache.write_bytes(b"PK\x03\x04 half a file")
    x_train, y_train, x_val, _ = digits.raw_split(0)
    assert (len(x_train), len(x_val)) == (1437, 360) and y_train.dtype == np.int64
    with np.load(cache) as rewritten:
        np.testing.assert_array_equal(rewritten["x_val"], x_val)


@pytest.mark.timeout(60)
def test_an_unwritable_cache_still_gives_the_split(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    x_train, _, x_val, _ = digits.raw_split(0)
    assert (len(x_train), len(x_val)) == (1437, 360)
