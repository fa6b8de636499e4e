"""Every test here runs compiled on a GPU (``make test-gpu``), and is skipped elsewhere.

``PALLAS_PAGED_GPU_TESTS_ON_CPU=1`` runs them on a CPU anyway, to work on the tests
themselves: the kernels are then the CPU's, so only what does not name the GPU means much.
"""

from __future__ import annotations

import os

import jax
import pytest

import pallas_paged
from pallas_paged import tiling

ON_GPU = jax.default_backend() == "gpu"


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="needs a GPU (make test-gpu)")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not ON_GPU and os.environ.get("PALLAS_PAGED_GPU_TESTS_ON_CPU") != "1":
                item.add_marker(skip)


gpu_only = pytest.mark.skipif(not ON_GPU, reason="checks what the GPU compiles")


def hopper_or_skip():
    """Skip unless this GPU is a Hopper, which the Mosaic GPU kernels (and cuDNN's packed
    layout, Hopper or later) are written for."""
    if not pallas_paged.hopper_gpu():
        pytest.skip(f"needs a Hopper GPU (compute capability {tiling.HOPPER.generation}.x), "
                    f"not {pallas_paged.cuda_capability()}")
