"""The HTTP API against a real uvicorn server on 127.0.0.1: queries, thumbnails, bad input, fuzzing; and the
``openalign serve`` process under hostile load (huge-pixel uploads, stalled bodies, non-finite numbers)."""

from __future__ import annotations

import base64
import io
import json
import resource
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from openalign.cli import main
from openalign.search.api import background_server, create_app, load_searcher
from openalign.search.demo import build_demo_index
from openalign.search.guard import exposure_warning
from serve_utils import start_server

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
        "model": Path(searcher.index.info["model"]).name,
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
    """`openalign serve INDEX --model DIR` serves DIR's model, so /health must name DIR, not the index's; it is
    open without the API key, so it names the model without its path on disk."""
    served = shutil.copytree(searcher.index.info["model"], tmp_path / "served-model")
    client = TestClient(create_app(load_searcher(demo_index, served), api_key="k"))
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["model"] == "served-model"
    assert str(tmp_path) not in health.text and str(Path(searcher.index.info["model"]).parent) not in health.text


def test_results_link_images_on_this_server_never_paths(http, demo_index):
    root = str(Path(demo_index).resolve().parent)  # the index and the image folder beside it
    for body in ({"text": "a red circle", "k": 10}, {"image_id": 3, "k": 10, "modality": "text"}, {"image": png_b64()}):
        response = http.post("/search", json=body)
        assert response.status_code == 200 and root not in response.text and str(demo_index) not in response.text
        for result in response.json()["results"]:
            assert result["url"] == f"/image/{result['image_id']}" and result["source_url"] is None
    served = http.get("/image/7")
    assert served.status_code == 200 and Image.open(io.BytesIO(served.content)).format == "JPEG"
    missing = http.get("/image/40")
    assert missing.status_code == 404 and missing.json()["detail"] == "image 40 is not available"


def test_source_urls_are_only_web_addresses_and_files_serve_without_thumbnails(searcher, tmp_path):
    """Shard samples are recorded with their shard's path; table and shard metadata may put a path in "url"."""
    from openalign.data.shards import write_shards
    from openalign.search import Searcher, open_index
    from openalign.search.build import BuildConfig, build_index

    urls = ["https://example.org/0.jpg", "/srv/private/photos/1.jpg", "file:///etc/2.jpg", "", "http://x/4.png"]
    samples = [
        {"key": f"{i:05d}", "jpg": Image.new("RGB", (48, 40), (40 * i, 90, 200)), "txt": f"a picture {i}",
         "json": {"url": url}}
        for i, url in enumerate(urls)
    ]  # fmt: skip
    write_shards(samples, tmp_path / "shards", samples_per_shard=5)
    build_index(searcher.model, searcher.tokenizer, str(tmp_path / "shards"), tmp_path / "idx", progress=False)
    client = TestClient(create_app(Searcher(open_index(tmp_path / "idx"), searcher.model, searcher.tokenizer)))
    response = client.post("/search", json={"text": "a picture", "k": 5})
    assert response.status_code == 200 and str(tmp_path) not in response.text and "/srv/private" not in response.text
    by_id = {r["id"]: r for r in response.json()["results"]}
    assert {i: r["source_url"] for i, r in by_id.items()} == {0: urls[0], 1: None, 2: None, 3: None, 4: urls[4]}
    assert all(r["url"] == f"/image/{i}" for i, r in by_id.items())

    # Without stored thumbnails a folder image is decoded from its recorded file, within the decode budget.
    (tmp_path / "folder").mkdir()
    Image.new("RGB", (900, 700), (10, 200, 30)).save(tmp_path / "folder" / "a.png")
    build_index(
        searcher.model, None, tmp_path / "folder", tmp_path / "plain", BuildConfig(thumbnail_size=0), progress=False
    )
    plain = TestClient(create_app(Searcher(open_index(tmp_path / "plain"), searcher.model), thumbnail_size=128))
    thumb = Image.open(io.BytesIO(plain.get("/image/0").content))
    assert thumb.size == (128, 100) and thumb.getpixel((60, 50)) == pytest.approx((10, 200, 30), abs=6)


# --------------------------------------------------------------------------------------------------
# The API key


KEY = "k3y-for-tests"


@pytest.fixture(scope="module")
def keyed(searcher):
    return TestClient(create_app(searcher, api_key=KEY, max_upload_bytes=MAX_UPLOAD))


@pytest.mark.parametrize(
    "headers",
    [{"Authorization": f"Bearer {KEY}"}, {"authorization": f"bearer {KEY}"}, {"X-API-Key": KEY}],
)
def test_the_api_key_opens_every_route(keyed, headers):
    assert keyed.post("/search", json={"text": "red", "k": 2}, headers=headers).status_code == 200
    for path in ("/image/1", "/", "/openapi.json", "/docs", "/static/app.js"):
        assert keyed.get(path, headers=headers).status_code == 200, path


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"X-API-Key": KEY[:-1]}, {"Authorization": KEY}, {"X-API-Key": ""}],
)
def test_requests_without_the_api_key_get_401(keyed, headers):
    for response in (
        keyed.post("/search", json={"text": "red"}, headers=headers),
        keyed.get("/image/1", headers=headers),
        keyed.get("/", headers=headers),
        keyed.get("/openapi.json", headers=headers),
    ):
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert "API key" in response.json()["detail"]
    # The key is checked before the body is read: an oversized body without it is a 401, not a 413.
    huge = keyed.post("/search", content=b"x" * (MAX_UPLOAD * 2), headers=headers)
    assert huge.status_code == 401
    assert keyed.get("/health", headers=headers).status_code == 200


@pytest.mark.parametrize(
    ("host", "key", "warns"),
    [
        ("127.0.0.1", None, False),
        ("localhost", None, False),
        ("::1", None, False),
        ("[::1]", None, False),
        ("127.0.0.2", None, False),
        ("0.0.0.0", None, True),
        ("::", None, True),
        ("192.168.1.20", None, True),
        ("search.example.org", None, True),
        ("0.0.0.0", "secret", False),
    ],
)
def test_exposure_warning(host, key, warns):
    warning = exposure_warning(host, key)
    assert (warning is not None) == warns
    if warning:
        assert host in warning and "OPENALIGN_API_KEY" in warning and "\n" not in warning


def test_serve_warns_beyond_loopback_and_reads_the_key_from_the_environment(demo_index, monkeypatch, capsys):
    import openalign.search.api as api

    started = []
    monkeypatch.setattr(api, "serve", lambda app, **kw: started.append((app, kw)))
    monkeypatch.delenv("OPENALIGN_API_KEY", raising=False)
    assert main(["serve", "--index", str(demo_index), "--host", "0.0.0.0", "--port", "0"]) == 0
    assert "without an API key" in capsys.readouterr().err
    assert TestClient(started[-1][0]).post("/search", json={"text": "red"}).status_code == 200

    monkeypatch.setenv("OPENALIGN_API_KEY", "from-env")
    assert main(["serve", "--index", str(demo_index), "--host", "0.0.0.0", "--port", "0", "--body-timeout-s", "5"]) == 0
    assert "without an API key" not in capsys.readouterr().err
    client = TestClient(started[-1][0])
    assert client.post("/search", json={"text": "red"}).status_code == 401
    assert client.post("/search", json={"text": "red"}, headers={"X-API-Key": "from-env"}).status_code == 200

    # --print-config never shows the key.
    assert main(["serve", "--api-key", "on-the-line", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "on-the-line" not in printed and "from-env" not in printed and "api_key: '***'" in printed


# --------------------------------------------------------------------------------------------------
# `openalign serve` in its own process, its address space capped so that a regression fails the test
# rather than exhausting the machine.

SERVER_ADDRESS_SPACE = 6 * 2**30
BODY_TIMEOUT_S = 2.0
# A quarter of the default 256 MB, for PNGs a quarter of the 36 Mpx the JPEGs have: the same ratio of
# budget to what the uploads ask for, at a quarter of the decoding time.
DECODE_BUDGET_MB = 64


def _cap_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (SERVER_ADDRESS_SPACE, SERVER_ADDRESS_SPACE))


@pytest.fixture(scope="module")
def served(demo_index, tmp_path_factory):
    flags = ("--body-timeout-s", str(BODY_TIMEOUT_S), "--decode-budget-mb", str(DECODE_BUDGET_MB))
    with start_server(demo_index, tmp_path_factory.mktemp("serve"), *flags, preexec=_cap_address_space) as server:
        yield server


def memory_mb(pid: int) -> dict[str, float]:
    """VmRSS (now) and VmHWM (peak since start or the last ``reset_peak``) of a process, in MB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0]) / 1024
    return out


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def flat_image_b64(fmt: str, side: int) -> str:
    """A side×side image of flat colour: a few hundred KB that decode to side² pixels."""
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (180, 60, 30)).save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize(("fmt", "side"), [("JPEG", 6000), ("PNG", 3000)])
def test_concurrent_huge_pixel_uploads_keep_server_memory_bounded(served, fmt, side):
    """16 concurrent uploads of 36-Mpx JPEGs (decoded at 1/8 scale) or 9-Mpx PNGs (decoded in full, 36 MB
    each, against a 64 MB decode budget), twice: the peak stays bounded and the second round adds nothing."""
    body = {"image": flat_image_b64(fmt, side), "k": 3}
    assert httpx.post(f"{served.url}/search", json=body, timeout=60).status_code == 200  # warm up
    reset_peak(served.pid)
    idle = memory_mb(served.pid)
    rounds = []
    for _ in range(2):
        with ThreadPoolExecutor(16) as pool:
            statuses = list(pool.map(lambda _: httpx.post(f"{served.url}/search", json=body, timeout=120), range(16)))
        assert [s.status_code for s in statuses] == [200] * 16
        rounds.append(memory_mb(served.pid))
    peak = rounds[-1]["VmHWM"]
    print(
        f"\n{fmt} {side}x{side} x16 concurrent x2 rounds: idle {idle['VmRSS']:.0f} MB, peak {peak:.0f} MB "
        f"(round peaks {rounds[0]['VmHWM']:.0f}/{rounds[1]['VmHWM']:.0f}), "
        f"resident after rounds {rounds[0]['VmRSS']:.0f}/{rounds[1]['VmRSS']:.0f} MB"
    )
    assert peak <= 1536
    assert peak - idle["VmRSS"] <= 400
    assert rounds[1]["VmHWM"] <= rounds[0]["VmHWM"] + 64
    assert rounds[1]["VmRSS"] <= rounds[0]["VmRSS"] + 64


def test_a_stalled_upload_gets_408_and_its_connection_closed(served):
    with socket.create_connection(("127.0.0.1", served.port), timeout=BODY_TIMEOUT_S + 20) as sock:
        head = b"POST /search HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
        sock.sendall(head + b'{"image": "' + b"A" * 50_000)
        start = time.monotonic()
        # Reading to the end returns only because the server closes the connection.
        raw = b"".join(iter(lambda: sock.recv(65536), b""))
        waited = time.monotonic() - start
    assert raw.startswith(b"HTTP/1.1 408") and b"did not arrive within 2 s" in raw
    assert BODY_TIMEOUT_S - 0.5 <= waited <= BODY_TIMEOUT_S + 5
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_an_upload_still_sending_at_the_timeout_reads_its_408(served):
    """A slow client, still sending past the read timeout, gets to read why it was dropped: closing on bytes
    it has sent but the server has not read would reset the connection instead."""
    head = b"POST /search HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10000000\r\n\r\n"
    with socket.create_connection(("127.0.0.1", served.port), timeout=BODY_TIMEOUT_S + 20) as sock:
        sock.sendall(head + b'{"image": "')
        start = time.monotonic()
        while time.monotonic() - start < BODY_TIMEOUT_S + 1.5:
            sock.sendall(b"A" * 65536)
            time.sleep(0.05)
        raw = b"".join(iter(lambda: sock.recv(65536), b""))
    assert raw.startswith(b"HTTP/1.1 408") and b"did not arrive within 2 s" in raw, raw[:200]
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_many_stalled_uploads_are_dropped_and_their_memory_freed(served):
    """Uploads that stall at 9 of 10 MB: those admitted get 408 at the timeout, those past the budget of
    bodies held at once 503, and the memory the bodies took is back afterwards."""
    idle = memory_mb(served.pid)["VmRSS"]
    head = b"POST /search HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10000000\r\n\r\n"
    statuses: list[int] = []

    def stall() -> None:
        with socket.create_connection(("127.0.0.1", served.port), timeout=BODY_TIMEOUT_S + 20) as sock:
            sock.sendall(head + b'{"image": "' + b"A" * 9_000_000)
            statuses.append(int(sock.recv(65536).split(b" ", 2)[1]))

    start = time.monotonic()
    threads = [threading.Thread(target=stall) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - start
    assert len(statuses) == 12 and set(statuses) <= {408, 503} and 408 in statuses, statuses
    assert took <= BODY_TIMEOUT_S + 8
    time.sleep(0.5)
    assert memory_mb(served.pid)["VmRSS"] <= idle + 64
    assert httpx.get(f"{served.url}/health").status_code == 200


NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e400", "-1e999"]
PLACES = [
    '{"text": "red", "text_weight": %s}',
    '{"image_id": %s}',
    '{"text": "red", "dedup": %s}',
    '{"text": "red", "plus": ["blue", %s]}',
    '{"text": "red", "k": 3, "extra": {"deep": [1, %s]}}',
]


@pytest.mark.parametrize("number", NON_FINITE)
def test_non_finite_numbers_get_a_one_line_422_and_the_connection_stays_open(served, number):
    conn = HTTPConnection("127.0.0.1", served.port, timeout=30)
    try:
        for place in PLACES:
            conn.request("POST", "/search", body=place % number, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            detail = json.loads(response.read())["detail"]
            sock = conn.sock
            assert response.status == 422 and isinstance(detail, str) and "\n" not in detail, detail
            assert number in detail and sock is not None
            conn.request(
                "POST", "/search", body='{"text": "red", "k": 2}', headers={"Content-Type": "application/json"}
            )
            ok = conn.getresponse()
            assert ok.status == 200 and len(json.loads(ok.read())["results"]) == 2
            assert conn.sock is sock  # the same keep-alive connection
    finally:
        conn.close()
    log = served.log.read_text()
    assert "Traceback" not in log and "Exception" not in log, log[-2000:]


def test_validation_errors_do_not_echo_a_whole_upload(http):
    response = http.post("/search", json={"text": "red", "colour": "x" * 100_000})
    assert response.status_code == 422 and "colour" in response.text and len(response.content) < 2000


def test_serve_answers_from_the_index_that_index_build_grew_without_a_restart(demo_index, tmp_path):
    model = str(load_searcher(demo_index).index.info["model"])
    photos, out = tmp_path / "photos", tmp_path / "idx"
    photos.mkdir()

    def add(numbers: range) -> None:
        for i in numbers:
            Image.new("RGB", (40, 30), (30 * i % 256, 90, 200 - 20 * i % 200)).save(photos / f"p{i}.png")
            (photos / f"p{i}.txt").write_text(f"a coloured card number {i}")
        build = ["index", "build", "--model", model, "--images", str(photos), "--out", str(out), "--captions"]
        assert main([*build, "--quiet"]) == 0

    add(range(5))
    with background_server(create_app(load_searcher(out), reload_check_s=0)) as url, httpx.Client(base_url=url) as http:
        assert http.get("/health").json()["images"] == 5
        held = http.post("/search", json={"text": "a coloured card", "k": 50}).json()["results"]
        assert len(held) == 5
        add(range(5, 12))
        deadline = time.monotonic() + 30
        while http.get("/health").json()["images"] != 12:
            assert time.monotonic() < deadline, "the server still answers from the old index"
            time.sleep(0.05)
        health = http.get("/health").json()
        assert (health["images"], health["captions"]) == (12, 12)
        results = http.post("/search", json={"text": "a coloured card", "k": 50}).json()["results"]
        assert sorted(r["id"] for r in results) == list(range(12))
        assert http.get("/image/11").status_code == 200
