"""Where a CPU benchmark ran and what it measured: the lines a result file gives besides
``gpu_report.header``'s, so that runs on machines that differ (this one has come with
AVX-512 and without) or on trees with uncommitted changes are not compared as equals."""

from __future__ import annotations

import os
import pathlib
import platform
import subprocess

from benchmarks import offline


def machine() -> str:
    """The CPU's model name, widest vector instructions and cores, and the load when the
    benchmark started (the same model name has come with and without AVX-512 here)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
            if name and flags:
                break
    except OSError:
        pass
    vectors = next((label for flag, label in (("avx512_bf16", "AVX-512 with BF16"), ("avx512f", "AVX-512"),
                                              ("avx2", "AVX2")) if flag in flags), "")
    name = f"{name} ({vectors})" if vectors else name
    return f"{name}, {os.cpu_count()} cores, {platform.system()}; {offline.machine_note()}"


def revision() -> str:
    """The checkout's commit, and the engine's files that differ from it (what was measured)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=pathlib.Path(__file__).parent.parent, capture_output=True,
                              text=True, check=True).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        changed = sorted({line[3:] for line in git("status", "--porcelain", "--", "engine", "models",
                                                   "pallas_paged").splitlines()})
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{commit} with uncommitted changes to {', '.join(changed)}" if changed else commit
