"""``openalign serve`` under hostile clients: bodies built to be expensive to validate, idle and slow-header
connections, more sockets than the server has file descriptors, and normal queries beside all of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.client import HTTPConnection
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from openalign.search.demo import build_demo_index


@pytest.fixture(scope="module")
def demo_index(tmp_path_factory):
    return build_demo_index(tmp_path_factory.mktemp("demo"), n_images=40, progress=False)


@contextmanager
def start_server(
    index: Path, log_dir: Path, *flags: str, preexec: Callable[[], None] | None = None
) -> Iterator[SimpleNamespace]:
    """``openalign serve --index INDEX FLAGS`` in its own process on a free port, stopped on exit."""
    from openalign.bench.search import free_port, wait_for_server

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "OPENALIGN_API_KEY"}
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
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(demo_index, tmp_path_factory):
    with start_server(demo_index, tmp_path_factory.mktemp("serve")) as s:
        yield s


def post_raw(port: int, body: bytes, timeout: float = 60) -> tuple[int, bytes]:
    conn = HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/search", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def many_keys(n: int) -> bytes:
    return json.dumps({"text": "red", **{f"k{i}": 0 for i in range(n)}}).encode()


# --------------------------------------------------------------------------------------------------
# Bodies by structure


def test_a_body_of_many_unknown_keys_gets_one_short_4xx_and_does_not_stall_the_server(server):
    body = many_keys(300_000)
    assert len(body) < 8 * 2**20  # well under the body limit
    answer: dict = {}

    def hostile() -> None:
        answer["status"], answer["reply"] = post_raw(server.port, body)

    thread = threading.Thread(target=hostile)
    thread.start()
    waits = []
    with httpx.Client(base_url=server.url, timeout=60) as client:
        while thread.is_alive() or not waits:
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            waits.append(time.monotonic() - start)
            time.sleep(0.02)
    thread.join()
    assert 400 <= answer["status"] < 500 and len(answer["reply"]) < 1000, answer["reply"][:300]
    detail = json.loads(answer["reply"])["detail"]
    assert isinstance(detail, str) and "keys" in detail and "\n" not in detail, detail
    assert max(waits) < 1.0, f"/health waited {max(waits):.2f} s beside the hostile body"


@pytest.mark.parametrize(
    ("body", "word"),
    [
        (b'{"text": "red", "extra": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "deep"),
        (b'{"text": "red", "extra": ' + b"[" * 40 + b"]" * 40 + b"}", "deep"),
        (json.dumps({"text": "red", "embedding": [0.5] * 600_000}).encode(), "items"),
        (json.dumps({"text": "red", "extra": [[1]] * 200_000}).encode(), "items"),
    ],
)
def test_deep_or_long_bodies_get_one_short_4xx(server, body, word):
    status, reply = post_raw(server.port, body)
    detail = json.loads(reply)["detail"]
    assert 400 <= status < 500 and len(reply) < 1000 and isinstance(detail, str) and word in detail, reply[:300]


def test_a_body_with_one_error_per_item_gets_a_bounded_reply(server):
    """8192 bad vector entries are within every structure limit but make 8192 validation errors."""
    status, reply = post_raw(server.port, json.dumps({"embedding": ["x"] * 8192}).encode())
    assert status == 422 and len(reply) < 8000, len(reply)
    assert "embedding" in reply.decode()


def test_valid_bodies_at_the_models_limits_still_pass(server):
    vector = np.random.default_rng(0).standard_normal(128).tolist()
    status, reply = post_raw(server.port, json.dumps({"embedding": vector, "k": 3}).encode())
    assert status == 200 and len(json.loads(reply)["results"]) == 3
    body = {"text": "a: b, c [d] {e}" * 60, "plus": ["x: y, [z]" * 100] * 16, "minus": ["{:}" * 300] * 16, "k": 2}
    status, reply = post_raw(server.port, json.dumps(body).encode())
    assert status == 200, reply[:300]
