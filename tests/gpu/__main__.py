"""``make test-gpu``: this package's tests, compiled on the GPU JAX sees; without one, say so.

    PYTHONPATH=. python -m tests.gpu [pytest arguments]

Exits 0 without running anything when JAX sees no GPU, and prints that nothing was tested.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import pytest


def main(argv: list[str]) -> int:
    backend = jax.default_backend()
    if backend != "gpu":
        print(f"make test-gpu: JAX sees no GPU (its backend is {backend!r}; jax {jax.__version__}), so nothing was "
              "tested. Run it where jax.devices() lists a GPU: see docs/gpu.md.")
        return 0
    device = jax.devices()[0]
    print(f"make test-gpu: {device.device_kind}, jax {jax.__version__}", flush=True)
    here = pathlib.Path(__file__).parent
    return int(pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", "-rs", str(here), *argv]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
