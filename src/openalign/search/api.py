"""The HTTP search API (FastAPI, documented at ``/docs`` and ``/openapi.json``) and the web page at ``/``.

``POST /search`` takes text, a base64 image, an embedding, "+"/"−" texts and a modality, and answers with
scored results; ``GET /image/{id}`` serves an indexed image's thumbnail; ``GET /health`` reports what is
served. One server may serve several named indexes (``index`` in a query, ``?index=`` for images; the
first is the default), and answers clip-retrieval's ``/knn-service``, ``/indices-list`` and ``/metadata``
too (``clip_retrieval``), behind the same limits.
Every bad request gets a 4xx with a JSON ``detail`` and never takes the server down: bodies are bounded in
size, time and number (``guard``), query images are decoded within a memory budget (``uploads``), and
results name images by this server's ``/image/{id}``, never by a path on its disk.
"""

from __future__ import annotations

import errno
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, HTTPException
from fastapi import Path as PathParam
from fastapi import Query as QueryParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field

from openalign.data.held_file import DamagedFile
from openalign.data.sources import BadInput, read_file
from openalign.data.transforms import BadImage
from openalign.search.build import make_thumbnail
from openalign.search.guard import (
    ApiKeyGuard,
    BodyGuard,
    BodyShape,
    MemoryBudget,
    StrictJSONRoute,
    capped_errors,
)
from openalign.search.query import MAX_K, Query, Searcher
from openalign.search.served import Indexes
from openalign.search.uploads import (
    Busy,
    DecodeBudget,
    decode_base64,
    decode_bounded,
    decode_side,
    unmap_large_frees,
)

STATIC = Path(__file__).parent / "static"
DEFAULT_MAX_UPLOAD = 8 * 2**20
DEFAULT_DECODE_BUDGET = 256 * 2**20
DEFAULT_REQUEST_MEMORY = 256 * 2**20
ShortText = Annotated[str, Field(max_length=1000)]
MAX_EMBED_DIM = 8192


class SearchRequest(BaseModel):
    """A query: any mix of text, one image (base64 or an indexed image's id) and +/− texts."""

    model_config = ConfigDict(extra="forbid")

    text: str | None = Field(None, max_length=1000, description="what to look for")
    image: str | None = Field(None, description="base64-encoded image bytes (or a data: URL)")
    image_id: int | None = Field(None, ge=0, description="query with an indexed image ('more like this')")
    embedding: list[float] | None = Field(
        None, min_length=1, max_length=MAX_EMBED_DIM, description="query with a vector of the index's width"
    )
    index: str | None = Field(None, max_length=200, description="which index to search (default: the first)")
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
    url: str = Field(description="the image on this server (/image/{image_id})")
    source_url: str | None = Field(None, description="the http(s) address the image was collected from, when known")
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
    model: str | None = Field(None, description="the model's name (its folder), without its path")


class Error(BaseModel):
    detail: Any


def decode_upload(data: str, budget: DecodeBudget, *, side: int, max_bytes: int, max_pixels: int) -> Any:
    """A base64 string (or data: URL) → RGB image of about ``side`` a side; HTTPException 400/413/503."""
    try:
        raw = decode_base64(data, max_bytes)
    except ValueError as err:
        raise HTTPException(400, f"image is not valid base64: {err}") from err
    except OverflowError as err:
        raise HTTPException(413, str(err)) from err
    try:
        return decode_bounded(raw, budget, side=side, max_pixels=max_pixels)
    except BadImage as err:
        raise HTTPException(400, f"image could not be decoded ({err.reason})") from err
    except Busy as err:
        raise HTTPException(503, f"{err}; retry later", headers={"Retry-After": "5"}) from err


def create_app(
    searcher: Searcher | Mapping[str, Searcher],
    *,
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD,
    max_pixels: int = 40_000_000,
    thumbnail_size: int = 256,
    body_timeout_s: float = 30.0,
    decode_budget_bytes: int = DEFAULT_DECODE_BUDGET,
    decode_wait_s: float = 60.0,
    request_memory_bytes: int = DEFAULT_REQUEST_MEMORY,
    api_key: str | None = None,
    reload_check_s: float = -1.0,
    body_shape: BodyShape | None = None,
) -> FastAPI:
    """The search app over ``searcher``.

    Uploads over ``max_upload_bytes`` (decoded) are refused (413), as are request bodies that take longer
    than ``body_timeout_s`` to arrive (408). Decoded query images hold at most ``decode_budget_bytes`` at
    once (a decode waits up to ``decode_wait_s`` for its share) and request bodies about
    ``request_memory_bytes`` (a body waits up to ``body_timeout_s``); then 503. With ``api_key`` every
    route but ``/health`` needs it. ``searcher`` may be a mapping of names to searchers, one per index. With
    ``reload_check_s`` ≥ 0 a version of an index that ``index build`` grew is swapped in (``Indexes``) at most
    that many seconds after a request notices it; below 0, the indexes served stay those given. JSON bodies
    larger in structure than ``body_shape`` allows get a one-line 422 before they are validated.
    """
    from openalign.search.clip_retrieval import add_clip_retrieval_routes

    indexes = Indexes(searcher, reload_check_s=reload_check_s)
    app = FastAPI(
        title="openalign search",
        version="1",
        description="Text → image, image → image, image → text and image ± text search over ALIGN embeddings.",
    )
    app.router.route_class = StrictJSONRoute
    app.state.body_shape = body_shape = body_shape or BodyShape()
    decode_budget = DecodeBudget(decode_budget_bytes, wait_s=decode_wait_s)

    def decode(data: str, searcher: Searcher) -> Any:
        side = decode_side(searcher.model)
        return decode_upload(data, decode_budget, side=side, max_bytes=max_upload_bytes, max_pixels=max_pixels)

    errors: dict[int | str, dict[str, Any]] = {code: {"model": Error} for code in (400, 401, 404, 408, 413, 422, 503)}

    @app.exception_handler(Exception)
    async def unexpected(_request: Any, err: Exception) -> JSONResponse:
        return JSONResponse({"detail": f"internal error: {type(err).__name__}"}, status_code=500)

    @app.exception_handler(DamagedFile)
    async def damaged(_request: Any, err: DamagedFile) -> JSONResponse:
        # The server's log names the file; the client learns what is damaged, not where the server keeps it.
        print(f"error: {err.path}: {err.reason}", file=sys.stderr)
        detail = f"internal error: the index is damaged ({err.public()}); rebuild it"
        return JSONResponse({"detail": detail}, status_code=500)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Any, err: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": capped_errors(list(err.errors()), body_shape)}, status_code=422)

    @app.get("/health", response_model=Health)
    def health() -> dict:
        first = indexes.get(None)[1]
        # /health is open without the API key, so it names the model by its folder, never its path on disk.
        model = Path(first.model_name).name if first.model_name else None
        return {"status": "ok", **first.index.summary(), "model": model}

    @app.post("/search", response_model=SearchResponse, responses=errors)
    def search(request: SearchRequest) -> dict:
        start = time.perf_counter()
        name, searcher = indexes.get(request.index)
        image = decode(request.image, searcher) if request.image else None
        query = Query(
            text=request.text,
            image=image,
            image_id=request.image_id,
            embedding=request.embedding,
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
            source = row.get("url") or ""
            results.append(
                {
                    "id": hit.id,
                    "score": round(hit.score, 6),
                    "caption": row.get("caption") or None,
                    "url": indexes.image_path(name, image_id),
                    "source_url": source if source.lower().startswith(("http://", "https://")) else None,
                    "key": row.get("key"),
                    "image_id": image_id,
                    "thumbnail": indexes.image_path(name, image_id),
                }
            )
        took = (time.perf_counter() - start) * 1000
        return {"results": results, "modality": request.modality, "took_ms": round(took, 3)}

    @app.get(
        "/image/{image_id}",
        responses={200: {"content": {"image/jpeg": {}}}, 404: {"model": Error}, 503: {"model": Error}},
        response_class=Response,
    )
    def thumbnail(
        image_id: Annotated[int, PathParam(ge=0, le=2**62)],
        index_name: Annotated[str | None, QueryParam(alias="index", max_length=200)] = None,
    ) -> Response:
        index = indexes.get(index_name)[1].index
        # One answer for an unknown id, a file outside the index's image roots, a missing or unreadable file:
        # a client learns nothing about the disk.
        unavailable = HTTPException(404, f"image {image_id} is not available")
        if image_id >= index.size("image"):
            raise unavailable
        data = index.thumbnails.get(image_id)
        if data is None:
            path = index.image_file(image_id)  # only a path the index recorded, never one from the request
            if path is None:
                raise unavailable
            try:
                image = decode_bounded(
                    read_file(path), decode_budget, side=thumbnail_size, max_pixels=max_pixels, keep_aspect=True
                )
            except (BadInput, OSError):
                raise unavailable from None
            except Busy as err:
                raise HTTPException(503, f"{err}; retry later", headers={"Retry-After": "5"}) from err
            data = make_thumbnail(image, thumbnail_size)
        return Response(data, media_type="image/jpeg", headers={"Cache-Control": "public, max-age=86400"})

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    add_clip_retrieval_routes(app, indexes, decode, errors)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    # base64 grows data by 4/3, and the JSON around it is small. The last middleware added runs first:
    # a request without the key is turned away before its body is read.
    app.add_middleware(
        BodyGuard,
        limit=max_upload_bytes * 4 // 3 + 64 * 1024,
        timeout_s=body_timeout_s,
        budget=MemoryBudget(request_memory_bytes),
        shape=body_shape,
    )
    if api_key:
        app.add_middleware(ApiKeyGuard, key=api_key)
    return app


@dataclass
class ServeConfig:
    """Settings of ``openalign serve``: where it listens, and the demo index it builds without ``--index``."""

    host: str = "127.0.0.1"  # address to listen on (0.0.0.0: every interface)
    port: int = 8000  # TCP port to listen on
    max_upload_mb: float = 8.0  # largest accepted query image
    log_level: Literal["debug", "info", "warning", "error"] = "info"  # the server's (uvicorn's) logging
    demo_images: int = 500  # demo: number of synthetic images
    demo_dir: str | None = None  # demo: where to build and cache the index (default: the user cache)
    seed: int = 0  # demo: synthetic world seed
    body_timeout_s: float = 30.0  # a request body not fully arrived after this many seconds gets 408
    decode_budget_mb: float = 256.0  # decoded query-image pixels held at once; more uploads wait their turn
    request_memory_mb: float = 256.0  # request bodies (and parsed copies) held at once; more wait, then 503
    api_key: str | None = None  # key every route but /health requires (default: $OPENALIGN_API_KEY)
    reload_check_s: float = 2.0  # seconds between looks for a new version from index build, swapped in live; -1: never
    # a connection whose request head has not fully arrived this long after it opened or got its answer is closed
    header_timeout_s: float = 10.0
    keep_alive_s: int = 5  # a connection idle this many seconds after its answer is closed
    # connections open at once (lowered to fit the open-file limit); past it the longest-idle one is closed, else 503
    max_connections: int = 1000

    def limits(self) -> ConnectionLimits:
        return ConnectionLimits(self.header_timeout_s, self.keep_alive_s, self.max_connections)

    def validate(self) -> None:
        names = ("max_upload_mb", "body_timeout_s", "decode_budget_mb", "request_memory_mb", "header_timeout_s")
        for name in (*names, "keep_alive_s", "max_connections"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if not (self.reload_check_s == -1 or 0 <= self.reload_check_s < float("inf")):
            raise ValueError(f"--reload-check-s must be -1 (never) or seconds ≥ 0, got {self.reload_check_s}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key is empty")


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, taken before the index loads so that a port in use is a one-line
    ``ValueError`` in a second rather than uvicorn's log lines once the index and model are up."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as err:
        raise ValueError(f"cannot listen on {host}: {getattr(err, 'strerror', None) or err}") from None
    sock = socket.socket(family, kind, proto)
    # As uvicorn does: a port left in TIME_WAIT by a server just stopped is free, one with a listener is not.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is in use (another server?); choose another with --port") from None
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a connection may take to send its request head or stay idle, and how many may be open."""

    header_timeout_s: float = 10.0
    keep_alive_s: int = 5
    max_connections: int = 1000


def uvicorn_config(app: FastAPI, limits: ConnectionLimits, **options: Any) -> Any:
    """uvicorn's settings for ``app`` with the header deadline, keep-alive time and connection cap of ``limits``
    (the cap and the listening backlog fitted to the open-file limit)."""
    import uvicorn

    from openalign.search.guard import connection_cap, guarded_protocol

    cap, backlog = connection_cap(limits.max_connections)
    protocol = guarded_protocol(limits.header_timeout_s, cap)
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=limits.keep_alive_s, backlog=backlog, **options)


def serve(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    sock: socket.socket | None = None,
    limits: ConnectionLimits | None = None,
) -> None:
    """Run ``app`` with uvicorn until interrupted, on ``sock`` (from ``listen``) when given, else binding
    ``host:port``, within the connection ``limits``; freed image buffers go back to the system at once."""
    import uvicorn

    unmap_large_frees()
    access_log = log_level in ("debug", "info")
    config = uvicorn_config(
        app, limits or ConnectionLimits(), host=host, port=port, log_level=log_level, access_log=access_log
    )
    uvicorn.Server(config).run(sockets=None if sock is None else [sock])


@contextmanager
def background_server(
    app: FastAPI, host: str = "127.0.0.1", port: int = 0, limits: ConnectionLimits | None = None
) -> Iterator[str]:
    """Run ``app`` under uvicorn in a background thread; yields its base URL and stops it on exit.

    ``port=0`` binds a free port. Useful in notebooks and tests that need a real HTTP server.
    """
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn_config(app, limits or ConnectionLimits(), log_level="warning", access_log=False))
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


def index_specs(specs: list[str]) -> dict[str, str]:
    """``--index`` values → {name: path}: ``NAME=PATH``, or a bare ``PATH`` named by its folder."""
    import re

    named: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or Path(spec).exists():
            name, path = Path(spec).resolve().name or "default", spec
        if name in named:
            raise ValueError(f"two indexes are named {name!r}; name them with --index NAME=PATH")
        named[name] = path
    return named


def load_searchers(
    indexes: Mapping[str, str | Path],
    model_path: str | Path | None = None,
    tokenizer_path: str | Path | None = None,
    *,
    allow_other_model: bool = False,
) -> dict[str, Searcher]:
    """A searcher per named index (``load_searcher``), loading a model shared by several indexes once."""
    from openalign.model.io import load_model
    from openalign.search.catalog import SearchIndex
    from openalign.search.fingerprint import check_same_model, tokenizer_sha256, weights_sha256
    from openalign.text import load_tokenizer

    models: dict[str, Any] = {}
    searchers: dict[str, Searcher] = {}
    hashes: dict[str, str | None] = {}
    for name, path in indexes.items():
        index = SearchIndex.open(path)
        model = model_path or index.info.get("model")
        if not model:
            if index.info.get("imported") is None:
                raise ValueError(f"{path} does not name its model; pass --model")
            searchers[name] = Searcher(index)
            continue
        tok = tokenizer_path or index.info.get("tokenizer") or model
        key = str(Path(model).resolve())
        if key not in models:
            loaded = load_model(model)
            models[key] = (loaded, {})
        loaded, tokenizers = models[key]
        tok_key = str(Path(tok).resolve())
        if tok_key not in tokenizers:
            tokenizers[tok_key] = load_tokenizer(tok, max_length=loaded.config.text.max_length)
        if index.info.get("imported") is None:  # imported embeddings were made elsewhere: no model to compare
            if key not in hashes:
                hashes[key] = weights_sha256(loaded)
            if "tokenizer:" + tok_key not in hashes:
                hashes["tokenizer:" + tok_key] = tokenizer_sha256(tokenizers[tok_key])
            found = {"weights": hashes[key], "tokenizer": hashes["tokenizer:" + tok_key]}
            check_same_model(index.info, path, str(model), found, allow_other_model=allow_other_model)
        searchers[name] = Searcher(index, loaded, tokenizers[tok_key], model_name=str(model))
    return searchers


def load_searcher(
    index_path: str | Path,
    model_path: str | Path | None = None,
    tokenizer_path: str | Path | None = None,
    *,
    allow_other_model: bool = False,
) -> Searcher:
    """Open an index with the model (and tokenizer) it was built with, or the ones given. An index built
    from embeddings without a model opens without one: it answers embedding queries only. A model other than
    the one that built the index is a ConfigError unless ``allow_other_model``."""
    searchers = load_searchers({"index": index_path}, model_path, tokenizer_path, allow_other_model=allow_other_model)
    return searchers["index"]
