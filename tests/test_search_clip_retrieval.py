"""clip-retrieval's own ``ClipClient`` against a running openalign server: text, image and embedding
queries get what ``/search`` answers; several indexes; ``/indices-list`` and ``/metadata``; flags that do
not apply are named in a header; the server's limits hold on these routes too.

``clip_retrieval/clip_client.py`` is loaded by file path: the package's ``__init__`` imports its whole
back end (faiss, open_clip, ...), which the test environment does not install."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from openalign.search.api import background_server, create_app, load_searchers
from openalign.search.demo import build_demo_index
from openalign.search.imported import import_embeddings

_PACKAGE = importlib.util.find_spec("clip_retrieval")
if _PACKAGE is None or _PACKAGE.origin is None:
    pytest.skip("clip-retrieval is not installed (.ci/run installs it with --no-deps)", allow_module_level=True)
CLIENT = Path(_PACKAGE.origin).parent / "clip_client.py"
MAX_UPLOAD = 200_000
IGNORED = "aesthetic_score,aesthetic_weight,use_safety_model,use_violence_detector"


def _clip_client_module():
    spec = importlib.util.spec_from_file_location("clip_retrieval_client", CLIENT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Tiny models on shared cores: intra-op threads only wait on each other."""


@pytest.fixture(scope="module")
def indexes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("indexes")
    demo = build_demo_index(root / "demo", n_images=40, progress=False)
    emb = np.random.default_rng(0).normal(size=(25, 128))
    np.save(root / "emb.npy", emb)
    urls = [f"https://example.org/{i}.jpg" for i in range(25)]
    pq.write_table(pa.table({"caption": [f"vector {i}" for i in range(25)], "url": urls}), root / "meta.parquet")
    import_embeddings(root / "emb.npy", root / "vectors", metadata=root / "meta.parquet")
    return {"demo": Path(demo), "vectors": root / "vectors"}


@pytest.fixture(scope="module")
def server(indexes: dict[str, Path]):
    app = create_app(load_searchers(indexes), max_upload_bytes=MAX_UPLOAD)
    with background_server(app) as url:
        yield url


@pytest.fixture(scope="module")
def clip_client():
    return _clip_client_module()


def _search(server: str, body: dict) -> list[dict]:
    response = httpx.post(f"{server}/search", json=body, timeout=30)
    assert response.status_code == 200, response.text
    results: list[dict] = response.json()["results"]
    return results


def _expected(server: str, body: dict) -> list[dict]:
    """``/search``'s answer in clip-retrieval's shape: its id, score, caption and absolute image address."""
    return [
        {
            "id": r["id"],
            "similarity": r["score"],
            "url": r["source_url"] or f"{server}{r['url']}",
            "caption": r["caption"],
        }
        for r in _search(server, body)
    ]


def _png(path: Path, colour: tuple[int, int, int]) -> Path:
    Image.new("RGB", (40, 30), colour).save(path)
    return path


@pytest.mark.parametrize("deduplicate", [True, False])
@pytest.mark.parametrize("modality", ["image", "text"])
def test_clip_client_text_queries_get_the_search_results(
    server: str, clip_client, deduplicate: bool, modality: str
) -> None:
    client = clip_client.ClipClient(
        url=f"{server}/knn-service",
        indice_name="demo",
        num_images=8,
        deduplicate=deduplicate,
        modality=clip_client.Modality(modality),
    )
    got = client.query(text="a red circle")
    body = {"text": "a red circle", "k": 8, "modality": modality, "dedup": 0.94 if deduplicate else None}
    assert got == _expected(server, body)
    assert len(got) == 8 or deduplicate


def test_clip_client_image_queries_send_the_file_as_base64(server: str, clip_client, tmp_path: Path) -> None:
    path = _png(tmp_path / "query.png", (200, 40, 40))
    client = clip_client.ClipClient(url=f"{server}/knn-service", indice_name="demo", num_images=6)
    got = client.query(image=str(path))
    image = base64.b64encode(path.read_bytes()).decode()
    assert got == _expected(server, {"image": image, "k": 6, "dedup": 0.94})
    assert got and all(r["url"].startswith(f"{server}/image/") for r in got)


def test_clip_client_embedding_queries_on_a_second_index(server: str, clip_client, indexes: dict[str, Path]) -> None:
    query = np.random.default_rng(1).normal(size=128).tolist()
    client = clip_client.ClipClient(url=f"{server}/knn-service", indice_name="vectors", num_images=5, deduplicate=False)
    got = client.query(embedding_input=query)
    assert got == _expected(server, {"embedding": query, "k": 5, "index": "vectors"})
    stored = np.load(indexes["vectors"] / "image" / "vectors.npy")
    unit = np.asarray(query) / np.linalg.norm(query)
    assert [r["id"] for r in got] == np.argsort(-(stored @ unit))[:5].tolist()
    assert got[0]["url"] == f"https://example.org/{got[0]['id']}.jpg"
    assert got[0]["caption"] == f"vector {got[0]['id']}"
    # The same vector on the demo index: its model is irrelevant to an embedding query.
    demo = clip_client.ClipClient(url=f"{server}/knn-service", indice_name="demo", num_images=3, deduplicate=False)
    assert demo.query(embedding_input=query) == _expected(server, {"embedding": query, "k": 3})
    # A text query where no model is attached is a clear 400, not a crash.
    response = httpx.post(f"{server}/knn-service", json={"text": "red", "indice_name": "vectors"}, timeout=30)
    assert response.status_code == 400 and "has none attached" in response.json()["detail"]


def test_indices_list_metadata_and_the_ignored_header(server: str, clip_client) -> None:
    assert httpx.get(f"{server}/indices-list").json() == ["demo", "vectors"]
    meta = httpx.post(f"{server}/metadata", json={"ids": [3, 0], "indice_name": "vectors"}).json()
    assert meta == [
        {"id": 3, "metadata": {"url": "https://example.org/3.jpg", "caption": "vector 3"}},
        {"id": 0, "metadata": {"url": "https://example.org/0.jpg", "caption": "vector 0"}},
    ]
    missing = httpx.post(f"{server}/metadata", json={"ids": [25], "indice_name": "vectors"})
    assert missing.status_code == 404 and "no image with id 25" in missing.json()["detail"]
    unknown = httpx.post(f"{server}/knn-service", json={"text": "red", "indice_name": "laion5B"})
    assert unknown.status_code == 404 and "demo, vectors" in unknown.json()["detail"]

    # The body ClipClient sends (its defaults), and what comes back with it.
    client = clip_client.ClipClient(url=f"{server}/knn-service", indice_name="demo", num_images=4)
    body = {
        "text": "a blue square", "image": None, "image_url": None, "embedding_input": None,
        "deduplicate": client.deduplicate, "use_safety_model": client.use_safety_model,
        "use_violence_detector": client.use_violence_detector, "indice_name": "demo",
        "use_mclip": client.use_mclip, "aesthetic_score": client.aesthetic_score,
        "aesthetic_weight": client.aesthetic_weight, "modality": "image", "num_images": 4, "num_result_ids": 4,
    }  # fmt: skip
    response = httpx.post(f"{server}/knn-service", content=json.dumps(body), timeout=30)
    assert response.status_code == 200 and response.headers["x-openalign-ignored"] == IGNORED
    assert response.json() == client.query(text="a blue square")
    plain = httpx.post(f"{server}/knn-service", json={"text": "a blue square", "num_images": 4, "deduplicate": True})
    assert "x-openalign-ignored" not in plain.headers and plain.json() == response.json()
    extra = httpx.post(f"{server}/knn-service", json={"text": "a blue square", "use_mclip": True, "new_flag": 1})
    assert extra.headers["x-openalign-ignored"] == "use_mclip,new_flag"
    odd = httpx.post(f"{server}/knn-service", json={"text": "a blue square", "a\r\nb": 1, "ß€": 2, "ok": 3})
    assert odd.status_code == 200 and odd.headers["x-openalign-ignored"] == "ok,2-other-fields"


def test_query_and_result_embeddings_on_request(server: str, indexes: dict[str, Path]) -> None:
    query = np.random.default_rng(2).normal(size=128)
    body = {"embedding_input": query.tolist(), "indice_name": "vectors", "num_images": 3, "return_embeddings": True}
    response = httpx.post(f"{server}/knn-service", json=body, timeout=30)
    sent = np.asarray(json.loads(response.headers["x-openalign-query-embedding"]))
    np.testing.assert_allclose(sent, query / np.linalg.norm(query), atol=1e-6)
    stored = np.load(indexes["vectors"] / "image" / "vectors.npy")
    for result in response.json():
        np.testing.assert_allclose(result["embedding"], stored[result["id"]], atol=1e-6)
        assert result["similarity"] == pytest.approx(float(stored[result["id"]] @ sent), abs=1e-5)


def test_bad_queries_get_a_json_4xx(server: str) -> None:
    cases = [
        ({"text": "red", "embedding_input": [1.0] * 128}, 400, "exactly one of"),
        ({}, 400, "exactly one of"),
        ({"image_url": "http://169.254.169.254/latest"}, 400, "not fetched"),
        ({"image": "not base64!"}, 400, "base64"),
        ({"embedding_input": [1.0, 2.0]}, 400, "128-d"),
        ({"text": "red", "num_images": 0}, 422, "num_images"),
        ({"text": "red", "modality": "audio"}, 422, "modality"),
    ]
    for body, status, fragment in cases:
        response = httpx.post(f"{server}/knn-service", json=body, timeout=30)
        assert response.status_code == status, (body, response.text)
        assert fragment in json.dumps(response.json()["detail"]), (body, response.text)


def test_the_server_limits_hold_on_the_clip_retrieval_routes(indexes: dict[str, Path]) -> None:
    app = create_app(load_searchers(indexes), max_upload_bytes=MAX_UPLOAD, api_key="k3y")
    client = TestClient(app)
    for method, path in (("post", "/knn-service"), ("get", "/indices-list"), ("post", "/metadata")):
        response = client.request(method.upper(), path, json={"text": "red", "ids": [0]})
        assert response.status_code == 401, path
    key = {"X-API-Key": "k3y"}
    assert client.get("/indices-list", headers=key).json() == ["demo", "vectors"]
    huge = client.post("/knn-service", content=b"x" * (MAX_UPLOAD * 2), headers=key)
    assert huge.status_code == 413
    # Under the body limit, over the decoded-upload limit (200 kB): the decode path's own check.
    noise = np.random.default_rng(0).integers(0, 255, (270, 270, 3), dtype=np.uint8)
    response = client.post("/knn-service", json={"image": _b64(Image.fromarray(noise))}, headers=key)
    assert response.status_code == 413 and "the limit is 200000" in response.json()["detail"]
    # A few kB that declare 42 Mpx: refused before its pixels are held.
    bomb = client.post("/knn-service", json={"image": _b64(Image.new("L", (7000, 6000)))}, headers=key)
    assert bomb.status_code == 400 and "could not be decoded" in bomb.json()["detail"]


def _b64(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_serve_takes_several_named_indexes(
    indexes: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import openalign.search.api as api
    from openalign.cli import main

    started: list = []
    monkeypatch.setattr(api, "serve", lambda app, **kw: started.append(app))
    # A bare path is named by its folder; NAME=PATH names it; the first is the default.
    assert main(["serve", "--index", str(indexes["vectors"]), "--index", f"pictures={indexes['demo']}"]) == 0
    client = TestClient(started[-1])
    assert client.get("/indices-list").json() == ["vectors", "pictures"]
    assert client.post("/search", json={"text": "red", "index": "pictures", "k": 2}).status_code == 200
    hits = client.post("/search", json={"embedding": [1.0] * 128, "k": 2}).json()["results"]
    assert hits[0]["url"] == f"/image/{hits[0]['id']}"
    hits = client.post("/search", json={"text": "red", "index": "pictures", "k": 1}).json()["results"]
    assert hits[0]["url"] == f"/image/{hits[0]['id']}?index=pictures"
    assert client.get(hits[0]["url"]).headers["content-type"] == "image/jpeg"
    # A single bare --index keeps working, named by its folder.
    assert main(["serve", "--index", str(indexes["demo"])]) == 0
    assert TestClient(started[-1]).get("/indices-list").json() == [indexes["demo"].name]
    capsys.readouterr()
    assert main(["serve", "--index", f"a={indexes['demo']}", "--index", f"a={indexes['vectors']}"]) == 2
    assert "two indexes are named 'a'" in capsys.readouterr().err
