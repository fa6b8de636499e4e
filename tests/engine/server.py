"""Starting the real server in a subprocess for tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx

SERVER_ARGS = ["--max-model-len", "512", "--max-num-seqs", "64", "--max-num-batched-tokens", "512",
               "--swap-space", "0.25"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(*args: str, timeout: float = 600):
    """Yield the base URL of ``python -m engine.serve`` on a free loopback port; stop it after."""
    port = free_port()
    log = open(os.devnull, "w")
    process = subprocess.Popen([sys.executable, "-m", "engine.serve", "--port", str(port), *args],
                               stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become healthy")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
