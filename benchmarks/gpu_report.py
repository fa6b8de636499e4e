"""What the GPU benchmarks share: how they say where they ran, and where their tables go.

A result file starts with the device, the versions of what ran, the date and the exact
command. The full-size files (``benchmarks/results/gpu_*.md``) hold GPU numbers only: on any
other backend only the ``--quick`` files are written, and the columns that need a GPU
(Triton, JAX's Pallas GPU ops, cuDNN) say :data:`NO_GPU` instead of a number.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import pathlib
import shlex
import sys

import jax

from benchmarks.timing import result_name, save_text

NO_GPU = "n/a (no GPU)"
NOT_INSTALLED = "not installed"
CUDA_PLUGINS = ("jax-cuda13-plugin", "jax-cuda12-plugin")  # listed with the versions where installed


def on_gpu() -> bool:
    """Whether JAX's default backend is a GPU."""
    return jax.default_backend() == "gpu"


def version(package: str) -> str:
    """The installed version of ``package`` (its distribution name), or :data:`NOT_INSTALLED`."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return NOT_INSTALLED


def header(module: str, argv: list[str], packages: tuple[str, ...] = ()) -> str:
    """The lines a result file starts with: device, versions (JAX, jaxlib and ``packages``),
    date (UTC) and the command that made it (``module`` run with ``argv``)."""
    device = jax.devices()[0]
    plugins = [name for name in CUDA_PLUGINS if version(name) != NOT_INSTALLED]
    versions = ", ".join(f"{name} {version(name)}" for name in ("jax", "jaxlib", *plugins, *packages))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "PYTHONPATH=. python -m " + shlex.join([module, *argv])
    return (f"Device: {device.device_kind} ({jax.default_backend()}, {jax.device_count()} device(s))  \n"
            f"Versions: Python {sys.version.split()[0]}, {versions}  \nDate: {date}  \nCommand: `{command}`")


def require_gpu_unless_quick(quick: bool) -> None:
    """Exit, saying why, when a full-size run is asked for off a GPU: its numbers would land in
    a ``gpu_*.md`` (and the full sizes take hours on a CPU)."""
    if not quick and not on_gpu():
        sys.exit(f"benchmarks/results/gpu_*.md hold GPU numbers only, and JAX's backend here is "
                 f"{jax.default_backend()}: nothing written (run with --quick to check the script here)")


def save(text: str, name: str, quick: bool) -> pathlib.Path:
    """Write ``text`` to ``benchmarks/results/<name>[_quick].md`` (a full-size result only from a GPU)."""
    require_gpu_unless_quick(quick)
    path = save_text(text, result_name(name, quick))
    print(f"wrote {path}")
    return path
