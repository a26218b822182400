"""The notebooks in the repository carry no outputs: diffs stay readable and nothing a run
printed (paths, run ids, a token in a traceback) is committed. tests/stack/test_stack.py runs
them."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_the_four_user_stories_are_there() -> None:
    assert [path.stem for path in NOTEBOOKS] == [
        "01-quickstart", "02-compare-runs", "03-sweeps", "04-cluster-jobs"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stripped_and_valid(path: Path) -> None:
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert set(notebook.metadata) <= {"kernelspec", "language_info"}, "widget state or extras"
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name}: outputs in a cell; clear them before committing "
                "(jupyter nbconvert --clear-output --inplace)")
        assert not {"execution", "collapsed", "scrolled"} & set(cell.metadata)
    tagged = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: one cell tagged 'parameters' (the suite sets them)"
