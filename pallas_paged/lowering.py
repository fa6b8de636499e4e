"""Lowering the kernels quietly: JAX 0.11 deprecated the Pallas Triton backend.

Since JAX 0.11, every lowering of a Pallas kernel for a GPU through Triton warns that the
backend "will be removed in a future JAX version" (JAX's direction on Hopper and later is
Mosaic GPU). The engine lowers dozens of programs at start-up, each with two kernels, so a
server's log would repeat it a hundred times. :func:`quietly` silences exactly that warning
around the project's own lowerings, and nothing else; which kernels each GPU runs is in the
docs/gpu.md.
"""

from __future__ import annotations

import contextlib
import warnings

TRITON_DEPRECATION = "The Pallas Triton backend is deprecated"


@contextlib.contextmanager
def quietly():
    """Lower inside this block without JAX's Pallas Triton deprecation warning (only that one)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
        yield
