"""Wheels for a GPU machine without internet: what ``make test-gpu`` and ``make bench-gpu``
need beyond the JAX (with CUDA), flax, numpy, torch and chex such machines come with.

    python -m tests.gpu.wheels .whl     # here, with the Python 3.12 leg's interpreter

downloads them for CPython 3.12 on x86-64 Linux, at the versions installed in the running
interpreter, into ``.whl/``; there, ``python3 -m pip install --no-index --no-deps --target
/tmp/site .whl/*.whl`` and ``PYTHONPATH=/tmp/site:.`` make them importable.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

WHEELS = [
    # the engine and the server
    "transformers", "tokenizers", "huggingface_hub", "hf-xet", "safetensors", "gguf", "PyYAML", "regex",
    "Jinja2", "MarkupSafe", "tqdm", "filelock", "fsspec", "packaging", "fastapi", "starlette", "annotated-doc",
    "pydantic", "pydantic_core", "annotated-types", "typing-inspection", "typing_extensions", "uvicorn", "h11",
    "click", "anyio", "sniffio", "idna", "prometheus_client", "opentelemetry-api", "importlib_metadata", "zipp",
    "rpds-py", "llguidance",
    # the tests: pytest, hypothesis and the openai client
    "pytest", "pytest-timeout", "iniconfig", "pluggy", "Pygments", "hypothesis", "sortedcontainers", "attrs",
    "openai", "httpx", "httpcore", "certifi", "distro", "jiter",
]
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64"]


def pinned() -> list[str]:
    """``name==version`` for each of :data:`WHEELS` installed here (others are left out)."""
    pins = []
    for name in WHEELS:
        try:
            pins.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return pins


def main(directory: str) -> int:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", directory, *pinned()]
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".whl"))
