"""README stays true: its two opening commands; docs/reference.md's tables match the registries."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
REFERENCE = (ROOT / "docs" / "reference.md").read_text()


def _commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert block and README.index(block.group(0)) < README.index("\n## "), "README must open "
    "with its commands"
    return [line for line in block.group(1).splitlines() if line and not line.startswith("#")]


def test_readme_opens_with_exactly_two_commands_and_ci_runs_the_test_command() -> None:
    setup, tests = _commands()
    assert "pip install torch==2.13.0" in setup and setup.endswith("raydeck demo")
    assert setup.index("torch==2.13.0") < setup.index('-e ".[dev]"')
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci.splitlines(), "CI must run README's exact test command"


@pytest.mark.parametrize("marker", ["settings-table", "metrics-table", "presets-table"])
def test_generated_tables_match_their_registries(marker: str) -> None:
    from raydeck.config.settings import settings_markdown
    from raydeck.observability.metrics import metrics_markdown
    from raydeck.train.presets import presets_markdown

    expected = {"settings-table": settings_markdown, "metrics-table": metrics_markdown,
                "presets-table": presets_markdown}[marker]()
    match = re.search(rf"<!-- {marker} -->\n(.*?)\n<!-- /{marker} -->", REFERENCE, re.S)
    assert match, f"docs/reference.md lacks the <!-- {marker} --> block"
    assert match.group(1).strip() == expected.strip(), (
        f"docs/reference.md's {marker} is stale: regenerate it from its registry (see its text)"
    )
