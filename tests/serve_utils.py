"""Run ``openalign serve`` in its own process for a test, as a user starts it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace


@contextmanager
def start_server(
    index: Path, log_dir: Path, *flags: str, preexec: Callable[[], None] | None = None
) -> Iterator[SimpleNamespace]:
    """``openalign serve --index INDEX FLAGS`` on a free port without an API key or allocator settings from
    the test's environment; stopped on exit. Yields its url, port, pid and log file."""
    from openalign.bench.search import free_port, stop_server, wait_for_server

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "OPENALIGN_API_KEY" and not k.startswith("MALLOC_")}
    cmd = [sys.executable, "-m", "openalign.cli", "serve", "--index", str(index), "--port", str(port),
           "--log-level", "warning", *flags]  # fmt: skip
    log_path = log_dir / f"server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, proc, 120)
        yield SimpleNamespace(url=url, port=port, pid=proc.pid, log=log_path)
    finally:
        stop_server(proc)
