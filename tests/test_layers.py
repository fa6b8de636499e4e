"""The layers hold and the code is lint-clean: the import contracts in pyproject.toml
(engine > models > pallas_paged; inside engine, entrypoints > loop > worker > records > core;
the core free of JAX) checked by import-linter, and ruff's checks (line length, import
order, pyflakes)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True)


def test_the_import_contracts_are_kept():
    result = run(sys.executable, "-c", "import sys, importlinter.cli as c; sys.exit(c.lint_imports())")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "3 kept, 0 broken" in result.stdout


def test_ruff_finds_nothing():
    result = run(sys.executable, "-m", "ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
