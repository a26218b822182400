"""Package data from the repository's top-level folders, copied into the wheel at build time.

``raydeck submit``, ``sweep``, ``dashboards`` and ``monitoring config`` default to files in
``runtime_envs/``, ``jobs/`` and ``dashboards/``. Those folders stay where their users expect
them (``ray job submit --runtime-env runtime_envs/cpu.yaml``, Docker Compose, Prometheus), so
they are the one copy in the repository; building the wheel copies them to ``raydeck/_data/``
and :mod:`raydeck.packaged` finds them there (or in the checkout, for an editable install).
Everything else is in pyproject.toml.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# folder -> glob of the files shipped (relative to the folder); keep MANIFEST.in in step.
PACKAGED = {"runtime_envs": "*.yaml", "jobs": "*.yaml", "dashboards": "**/*"}
SKIPPED_PARTS = {"__pycache__"}


def packaged_files() -> dict[str, Path]:
    """Every file the wheel carries under ``raydeck/_data``, by its path there."""
    files = {}
    for folder, pattern in PACKAGED.items():
        found = [path for path in sorted((ROOT / folder).glob(pattern)) if path.is_file()
                 and not SKIPPED_PARTS & set(path.parts) and path.suffix != ".pyc"]
        if not found:
            raise FileNotFoundError(f"{ROOT / folder}: no {pattern} to package; build from a "
                                    "checkout (or an sdist) that has it")
        files.update({path.relative_to(ROOT).as_posix(): path for path in found})
    return files


class BuildWithData(build_py):
    """build_py, plus the top-level folders' files under ``raydeck/_data``."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install reads them from the checkout
        for relative, source in packaged_files().items():
            target = Path(self.build_lib) / "raydeck" / "_data" / relative
            self.mkpath(str(target.parent))
            self.copy_file(str(source), str(target))


setup(cmdclass={"build_py": BuildWithData})
