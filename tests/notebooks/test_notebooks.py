"""The notebooks in notebooks/ run top to bottom without an error.

Each runs in a fresh kernel whose working directory is the repository root. The kernel is the
interpreter running the tests (the venv's), found under the name the notebooks ask for,
``python3``, in a kernelspec written for the test: ``JUPYTER_PATH`` comes first in Jupyter's
search, so a ``python3`` kernel registered elsewhere (say, in the user's home) cannot shadow it.
The kernel shares the tests' engine cache (``PALLAS_PAGED_CACHE_DIR``, set by tests/conftest.py),
so the converted model and compiled programs are reused.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def kernel_name(tmp_path, monkeypatch) -> str:
    spec = tmp_path / "kernels" / "python3"
    spec.mkdir(parents=True)
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    spec.joinpath("kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (pallas-paged tests)",
        "language": "python",
        "env": {"PALLAS_PAGED_CACHE_DIR": os.environ["PALLAS_PAGED_CACHE_DIR"], "PYTHONPATH": python_path},
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    return "python3"


def run_notebook(name: str, kernel_name: str) -> None:
    """Execute every cell; nbclient raises CellExecutionError (with the traceback) on the first error."""
    notebook = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    assert notebook.metadata.kernelspec.name == kernel_name
    client = NotebookClient(notebook, kernel_name=kernel_name, timeout=600,
                            resources={"metadata": {"path": str(ROOT)}})
    client.execute()


def test_paged_attention_notebook(kernel_name):
    run_notebook("01_paged_attention.ipynb", kernel_name)


@pytest.mark.slow
def test_serving_notebook(kernel_name):
    run_notebook("02_serving.ipynb", kernel_name)
