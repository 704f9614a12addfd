"""The HTTP search API (FastAPI, documented at ``/docs`` and ``/openapi.json``) and the web page at ``/``.

``POST /search`` takes text, a base64 image, "+"/"−" texts and a modality, and answers with scored
results; ``GET /image/{id}`` serves an indexed image's thumbnail; ``GET /health`` reports what is served.
Every bad request gets a 4xx with a JSON ``detail`` and never takes the server down.
"""

from __future__ import annotations

import base64
import binascii
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, HTTPException
from fastapi import Path as PathParam
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field

from openalign.data.sources import BadInput, read_file
from openalign.data.transforms import BadImage, decode_image
from openalign.search.build import make_thumbnail
from openalign.search.query import MAX_K, Query, Searcher

STATIC = Path(__file__).parent / "static"
DEFAULT_MAX_UPLOAD = 8 * 2**20
ShortText = Annotated[str, Field(max_length=1000)]


class SearchRequest(BaseModel):
    """A query: any mix of text, one image (base64 or an indexed image's id) and +/− texts."""

    model_config = ConfigDict(extra="forbid")

    text: str | None = Field(None, max_length=1000, description="what to look for")
    image: str | None = Field(None, description="base64-encoded image bytes (or a data: URL)")
    image_id: int | None = Field(None, ge=0, description="query with an indexed image ('more like this')")
    plus: list[ShortText] = Field(default_factory=list, max_length=16, description="texts to add")
    minus: list[ShortText] = Field(default_factory=list, max_length=16, description="texts to subtract")
    k: int = Field(10, ge=1, le=MAX_K, description="number of results")
    modality: Literal["image", "text"] = Field("image", description="search images or captions")
    text_weight: float = Field(2.0, ge=0, le=100, description="weight of each text part (paper: 2)")
    image_weight: float = Field(1.0, ge=0, le=100, description="weight of the image part (paper: 1)")
    dedup: float | None = Field(None, gt=0, le=1, description="drop results this similar to a better one")


class SearchResult(BaseModel):
    id: int = Field(description="id in the searched store (image id, or caption id for modality=text)")
    score: float = Field(description="cosine similarity to the query")
    caption: str | None = None
    url: str | None = Field(None, description="the image's source url or path, when known")
    key: str | None = None
    image_id: int = Field(description="the image this result shows (its own id for images)")
    thumbnail: str = Field(description="path of the thumbnail on this server")


class SearchResponse(BaseModel):
    results: list[SearchResult]
    modality: Literal["image", "text"]
    took_ms: float


class Health(BaseModel):
    status: Literal["ok"]
    images: int
    captions: int
    embed_dim: int
    index: dict[str, str]
    model: str | None = None


class Error(BaseModel):
    detail: Any


class BodyLimit:
    """Rejects request bodies over ``limit`` bytes with 413 before the app parses them (ASGI middleware)."""

    def __init__(self, app: Any, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._reject(scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                await self._reject(scope, receive, send)
                return
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            message: dict = await receive()
            return message

        await self.app(scope, replay, send)

    async def _reject(self, scope: dict, receive: Any, send: Any) -> None:
        response = JSONResponse({"detail": f"request body over {self.limit} bytes"}, status_code=413)
        await response(scope, receive, send)


def decode_upload(data: str, max_bytes: int, max_pixels: int) -> Any:
    """A base64 string (or data: URL) → RGB image; HTTPException 400/413 on bad input."""
    if data.startswith("data:"):
        _, _, data = data.partition(",")
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as err:
        raise HTTPException(400, f"image is not valid base64: {err}") from err
    if len(raw) > max_bytes:
        raise HTTPException(413, f"image is {len(raw)} bytes; the limit is {max_bytes}")
    try:
        return decode_image(raw, max_pixels=max_pixels)
    except BadImage as err:
        raise HTTPException(400, f"image could not be decoded ({err.reason})") from err


def create_app(
    searcher: Searcher,
    *,
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD,
    max_pixels: int = 40_000_000,
    thumbnail_size: int = 256,
) -> FastAPI:
    """The search app over ``searcher``; uploads over ``max_upload_bytes`` (decoded) are refused."""
    index = searcher.index
    app = FastAPI(
        title="openalign search",
        version="1",
        description="Text → image, image → image, image → text and image ± text search over ALIGN embeddings.",
    )
    errors: dict[int | str, dict[str, Any]] = {400: {"model": Error}, 413: {"model": Error}, 422: {"model": Error}}

    @app.exception_handler(Exception)
    async def unexpected(_request: Any, err: Exception) -> JSONResponse:
        return JSONResponse({"detail": f"internal error: {type(err).__name__}"}, status_code=500)

    @app.get("/health", response_model=Health)
    def health() -> dict:
        return {"status": "ok", **index.summary(), "model": searcher.model_name}

    @app.post("/search", response_model=SearchResponse, responses=errors)
    def search(request: SearchRequest) -> dict:
        start = time.perf_counter()
        image = decode_upload(request.image, max_upload_bytes, max_pixels) if request.image else None
        query = Query(
            text=request.text,
            image=image,
            image_id=request.image_id,
            plus=list(request.plus),
            minus=list(request.minus),
            k=request.k,
            modality=request.modality,
            text_weight=request.text_weight,
            image_weight=request.image_weight,
            dedup=request.dedup,
        )
        try:
            hits = searcher.search(query)
        except ValueError as err:
            raise HTTPException(400, str(err)) from err
        results = []
        for hit in hits:
            row = hit.row
            image_id = int(row["image_id"]) if request.modality == "text" else hit.id
            results.append(
                {
                    "id": hit.id,
                    "score": round(hit.score, 6),
                    "caption": row.get("caption") or None,
                    "url": row.get("url") or row.get("path") or None,
                    "key": row.get("key"),
                    "image_id": image_id,
                    "thumbnail": f"/image/{image_id}",
                }
            )
        took = (time.perf_counter() - start) * 1000
        return {"results": results, "modality": request.modality, "took_ms": round(took, 3)}

    @app.get(
        "/image/{image_id}",
        responses={200: {"content": {"image/jpeg": {}}}, 404: {"model": Error}},
        response_class=Response,
    )
    def thumbnail(image_id: Annotated[int, PathParam(ge=0, le=2**62)]) -> Response:
        if image_id >= index.size("image"):
            raise HTTPException(404, f"no image with id {image_id}")
        data = index.thumbnails.get(image_id)
        if data is None:
            # Only paths recorded in the metadata are ever opened, never one taken from the request.
            path = Path(index.rows("image", [image_id])[0]["path"] or "")
            if not path.is_file():
                raise HTTPException(404, f"image {image_id} has no thumbnail and its file is not readable")
            try:
                data = make_thumbnail(decode_image(read_file(path), max_pixels=max_pixels), thumbnail_size)
            except BadInput as err:
                raise HTTPException(404, f"image {image_id} could not be read") from err
        return Response(data, media_type="image/jpeg", headers={"Cache-Control": "public, max-age=86400"})

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    # base64 grows data by 4/3, and the JSON around it is small.
    app.add_middleware(BodyLimit, limit=max_upload_bytes * 4 // 3 + 64 * 1024)
    return app


@dataclass
class ServeConfig:
    """Settings of ``openalign serve``: where it listens, and the demo index it builds without ``--index``."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_upload_mb: float = 8.0  # largest accepted query image
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    demo_images: int = 500  # demo: number of synthetic images
    demo_dir: str | None = None  # demo: where to build and cache the index (default: the user cache)
    seed: int = 0  # demo: synthetic world seed

    def validate(self) -> None:
        if self.max_upload_mb <= 0:
            raise ValueError(f"--max-upload-mb must be positive, got {self.max_upload_mb}")


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run ``app`` with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=log_level in ("debug", "info"))


@contextmanager
def background_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Run ``app`` under uvicorn in a background thread; yields its base URL and stops it on exit.

    ``port=0`` binds a free port. Useful in notebooks and tests that need a real HTTP server.
    """
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def load_searcher(
    index_path: str | Path, model_path: str | Path | None = None, tokenizer_path: str | Path | None = None
) -> Searcher:
    """Open an index with the model (and tokenizer) it was built with, or the ones given."""
    from openalign.model.io import load_model
    from openalign.search.catalog import SearchIndex
    from openalign.text import load_tokenizer

    index = SearchIndex.open(index_path)
    model_path = model_path or index.info.get("model")
    if not model_path:
        raise ValueError(f"{index_path} does not name its model; pass --model")
    model = load_model(model_path)
    tokenizer_path = tokenizer_path or index.info.get("tokenizer") or model_path
    tokenizer = load_tokenizer(tokenizer_path, max_length=model.config.text.max_length)
    return Searcher(index, model, tokenizer, model_name=str(model_path))
