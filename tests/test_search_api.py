"""The HTTP API against a real uvicorn server on 127.0.0.1: queries, thumbnails, bad input, fuzzing."""

from __future__ import annotations

import base64
import io
import shutil
import socket

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from openalign.search.api import background_server, create_app, load_searcher
from openalign.search.demo import build_demo_index

MAX_UPLOAD = 200_000


@pytest.fixture(scope="module")
def demo_index(tmp_path_factory):
    return build_demo_index(tmp_path_factory.mktemp("demo"), n_images=40, progress=False)


@pytest.fixture(scope="module")
def searcher(demo_index):
    return load_searcher(demo_index)


@pytest.fixture(scope="module")
def server(searcher):
    with background_server(create_app(searcher, max_upload_bytes=MAX_UPLOAD)) as url:
        yield url


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=30) as client:
        yield client


def png_b64(size=(40, 30), colour=(200, 30, 30)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_health_and_page(http, searcher):
    health = http.get("/health").json()
    assert health == {
        "status": "ok",
        "images": 40,
        "captions": 40,
        "embed_dim": 128,
        "index": {"image": "exact", "text": "exact"},
        "model": str(searcher.index.info["model"]),
    }
    page = http.get("/")
    assert page.status_code == 200 and 'id="query"' in page.text
    assert http.get("/static/app.js").status_code == 200
    assert "/search" in http.get("/openapi.json").json()["paths"]


def test_text_search_returns_the_exact_ranking(http, searcher):
    body = http.post("/search", json={"text": "a red circle", "k": 5}).json()
    results = body["results"]
    q = searcher.embed_texts(["a red circle"])[0]
    scores = np.asarray(searcher.index.stores["image"].vectors) @ q
    assert [r["id"] for r in results] == list(np.argsort(-scores, kind="stable")[:5])
    assert [r["score"] for r in results] == pytest.approx(sorted(scores)[::-1][:5], abs=1e-5)
    assert results[0]["caption"] and results[0]["thumbnail"] == f"/image/{results[0]['id']}"


def test_image_upload_image_id_and_caption_search(http):
    by_upload = http.post("/search", json={"image": png_b64(), "k": 3}).json()["results"]
    assert len(by_upload) == 3
    data_url = "data:image/png;base64," + png_b64()
    assert http.post("/search", json={"image": data_url, "k": 3}).json()["results"] == by_upload
    more = http.post("/search", json={"image_id": 4, "k": 2}).json()["results"]
    assert more[0]["id"] == 4 and more[0]["score"] == pytest.approx(1.0, abs=1e-5)
    captions = http.post("/search", json={"image_id": 4, "k": 5, "modality": "text"}).json()
    assert captions["modality"] == "text" and all(r["caption"] for r in captions["results"])
    mixed = http.post("/search", json={"image_id": 4, "plus": ["blue"], "minus": ["red"], "k": 4}).json()
    assert len(mixed["results"]) == 4


def test_thumbnails(http):
    response = http.get("/image/3")
    assert response.status_code == 200 and response.headers["content-type"] == "image/jpeg"
    assert Image.open(io.BytesIO(response.content)).size == (64, 64)


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"image": "%%% not base64 %%%"}, 400, "base64"),
        ({"image": base64.b64encode(b"GIF89a but not really").decode()}, 400, "could not be decoded"),
        ({"image": base64.b64encode(b"\0" * (MAX_UPLOAD + 10)).decode()}, 413, "limit"),
        ({"text": "red", "k": 0}, 422, "k"),
        ({"text": "red", "k": 1001}, 422, "k"),
        ({"text": "red", "k": "ten"}, 422, "k"),
        ({}, 400, "empty query"),
        ({"text": "   ", "minus": ["red"]}, 400, "empty query"),
        ({"text": "red", "modality": "audio"}, 422, "modality"),
        ({"text": "red", "colour": "blue"}, 422, "colour"),
        ({"image_id": 10_000}, 400, "no image with id"),
        ({"text": "red", "plus": ["x"] * 17}, 422, "plus"),
    ],
)
def test_bad_requests_get_a_json_4xx(http, body, status, fragment):
    response = http.post("/search", json=body)
    assert response.status_code == status, response.text
    assert fragment in str(response.json()["detail"])
    assert http.get("/health").status_code == 200


def test_bad_bodies_and_paths(http):
    assert http.post("/search", content=b"{not json", headers={"content-type": "application/json"}).status_code == 422
    huge = http.post("/search", content=b"x" * (MAX_UPLOAD * 2), headers={"content-type": "application/json"})
    assert huge.status_code == 413 and "detail" in huge.json()
    for path in ("/image/99999", "/image/-1", "/image/abc", "/image/..%2F..%2Fetc%2Fpasswd", "/image/%2e%2e/secret"):
        response = http.get(path)
        assert 400 <= response.status_code < 500, path
        assert response.headers["content-type"].startswith("application/json")
        assert "root:" not in response.text
    # Clients normalise "..", so send the traversal byte for byte.
    host, port = http.base_url.host, http.base_url.port
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(b"GET /image/../../../../etc/passwd HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = b"".join(iter(lambda: sock.recv(65536), b"")).decode("latin-1")
    assert raw.startswith("HTTP/1.1 404") and "root:" not in raw
    assert http.get("/health").status_code == 200


def test_concurrent_clients_get_no_server_errors(server):
    from concurrent.futures import ThreadPoolExecutor

    from openalign.bench.search import _request_bodies

    def client(seed: int) -> list[int]:
        with httpx.Client(base_url=server, timeout=60) as c:
            return [c.post("/search", json=body).status_code for body in _request_bodies(20, seed, 40, 10)]

    with ThreadPoolExecutor(16) as pool:
        statuses = [s for batch in pool.map(client, range(16)) for s in batch]
    assert len(statuses) == 320 and set(statuses) == {200}


@pytest.mark.slow
def test_serve_bench_drives_the_cli_server(demo_index):
    from openalign.bench.search import ServeBenchSettings, run_serve_bench

    result = run_serve_bench(ServeBenchSettings(index=str(demo_index), clients=3, requests=5))
    assert result["requests"] == 15 and result["server_errors"] == 0 and result["server_alive_after"]
    assert result["statuses"] == {"200": 15}


def test_openapi_fuzzing(server):
    """Requests generated from the OpenAPI schema: no 5xx, responses match their documented schemas."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(f"{server}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/search", "/image/{image_id}", "/health"}
    for op in operations:

        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=op.as_strategy())
        def check(case):
            # Schema-valid requests can still be meaningless (no query at all, bytes that are not an
            # image, an id past the end); those are 400s by design, so that one check is left out.
            response = case.call_and_validate(
                base_url=server, timeout=30, excluded_checks=[schemathesis.checks.positive_data_acceptance]
            )
            if response.status_code >= 400:
                assert response.headers["content-type"][0].startswith("application/json")

        check()
    with httpx.Client(base_url=server) as client:
        assert client.get("/health").status_code == 200


def test_health_names_the_model_the_server_was_started_with(demo_index, searcher, tmp_path):
    """`openalign serve INDEX --model DIR` serves DIR's model, so /health must say DIR, not the index's."""
    served = shutil.copytree(searcher.index.info["model"], tmp_path / "served-model")
    client = TestClient(create_app(load_searcher(demo_index, served)))
    assert client.get("/health").json()["model"] == str(served)
