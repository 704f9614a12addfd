"""clip-retrieval's back-end routes on the openalign server, so its ``ClipClient`` and front end query an
openalign index as they would a ``clip-retrieval back`` server.

``POST /knn-service`` takes its request (``text``, base64 ``image`` or ``embedding_input``, ``modality``,
``num_images``, ``indice_name``, ``deduplicate``) and answers with its list of ``{id, similarity, url,
caption}``; ``GET /indices-list`` names the indexes; ``POST /metadata`` gives the metadata of ids. Its
flags that have no counterpart here (``use_mclip``, ``aesthetic_score`` and ``aesthetic_weight``,
``use_safety_model``, ``use_violence_detector``, and any field it may add) are accepted and ignored, and the
response names them in ``X-Openalign-Ignored``. ``image_url`` is refused: the server never fetches
addresses a request names. ``deduplicate`` drops results whose cosine to a better-ranked kept one exceeds
0.94, clip-retrieval's threshold (it drops every member but the first of each group linked by such pairs,
so a chain of near copies may lose one more result there than here). ``return_embeddings`` (openalign's
own) adds each result's stored vector and sends the query vector in ``X-Openalign-Query-Embedding`` (a
JSON list).

These routes run behind the same guards as ``/search``: the API key, the body size and time limits,
and the shared decode budget for query images.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from openalign.search.query import MAX_K, Query, Searcher
from openalign.search.served import Indexes

DEDUP_THRESHOLD = 0.94  # clip-retrieval's connected-components threshold on result embeddings
IGNORED_FLAGS = ("use_mclip", "aesthetic_score", "aesthetic_weight", "use_safety_model", "use_violence_detector")
MAX_EMBED_DIM = 8192
# clip-retrieval reads bodies as JSON whatever their content type, and its ClipClient sends none. FastAPI
# did too until 0.132, which refuses them unless a route opts out.
_ANY_CONTENT_TYPE: dict[str, Any] = (
    {"strict_content_type": False}
    if "strict_content_type" in inspect.signature(APIRouter.add_api_route).parameters
    else {}
)


class KnnRequest(BaseModel):
    """clip-retrieval's ``/knn-service`` request; fields it has that do not apply here are taken and ignored."""

    model_config = ConfigDict(extra="allow")

    text: str | None = Field(None, max_length=1000, description="what to look for")
    image: str | None = Field(None, description="base64-encoded image bytes")
    image_url: str | None = Field(None, max_length=2000, description="not fetched: send the image as base64")
    embedding_input: list[float] | None = Field(
        None, min_length=1, max_length=MAX_EMBED_DIM, description="query vector of the index's width"
    )
    modality: Literal["image", "text"] = Field("image", description="search images or captions")
    num_images: int = Field(40, ge=1, le=MAX_K, description="number of results")
    num_result_ids: int | None = Field(None, ge=1, description="candidates searched (clip-retrieval); ignored")
    indice_name: str | None = Field(None, max_length=200, description="which index (default: the first)")
    deduplicate: bool = Field(False, description=f"drop results with cosine above {DEDUP_THRESHOLD} to a better one")
    use_mclip: bool | None = Field(None, description="ignored: no multilingual text model here")
    aesthetic_score: int | str | None = Field(None, description="ignored: no aesthetic embeddings here")
    aesthetic_weight: float | str | None = Field(None, description="ignored")
    use_safety_model: bool | None = Field(None, description="ignored: no safety model here")
    use_violence_detector: bool | None = Field(None, description="ignored: no violence detector here")
    return_embeddings: bool = Field(False, description="add result vectors, and the query vector as a header")


class KnnResult(BaseModel):
    id: int = Field(description="image id (caption id for modality=text)")
    similarity: float = Field(description="cosine similarity to the query")
    url: str = Field(description="where the image was collected from, or its address on this server")
    caption: str | None = None
    embedding: list[float] | None = Field(None, description="the result's stored vector (return_embeddings)")


class MetadataRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    ids: list[int] = Field(max_length=MAX_K, description="image ids")
    indice_name: str | None = Field(None, max_length=200, description="which index (default: the first)")


class MetadataEntry(BaseModel):
    id: int
    metadata: dict[str, Any]


def ignored_fields(request: KnnRequest) -> list[str]:
    """The fields sent with a value that would change clip-retrieval's answer but not this one's."""
    ignored = [name for name in IGNORED_FLAGS if getattr(request, name) not in (None, False, "")]
    if request.num_result_ids is not None and request.num_result_ids != request.num_images:
        ignored.append("num_result_ids")
    # Unknown names go into a header, so only plain ones are echoed (a name with a line break or a
    # non-Latin-1 character cannot be sent in one); the rest are counted.
    extra = sorted(request.model_extra or {})
    plain = [name for name in extra if re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name)][:32]
    more = len(extra) - len(plain)
    return ignored + plain + ([f"{more}-other-fields"] if more else [])


def _url(row: dict[str, Any], name: str, indexes: Indexes, image_id: int, base: str) -> str:
    """The image's web address when it has one, else its full address on this server (clip-retrieval's
    clients show ``url`` as is), never a path on this server's disk."""
    source = str(row.get("url") or "")
    if source.lower().startswith(("http://", "https://")):
        return source
    return base.rstrip("/") + indexes.image_path(name, image_id)


def add_clip_retrieval_routes(
    app: FastAPI, indexes: Indexes, decode: Callable[[str, Searcher], Any], errors: dict[int | str, dict[str, Any]]
) -> None:
    """Add ``/knn-service``, ``/indices-list`` and ``/metadata`` to ``app``; ``decode`` turns a base64 upload
    into an image within the app's limits."""

    @app.get("/indices-list", response_model=list[str])
    def indices_list() -> list[str]:
        return indexes.names()

    def knn_service(request: KnnRequest, http: Request) -> JSONResponse:
        name, searcher = indexes.get(request.indice_name)
        given = [f for f in ("text", "image", "embedding_input") if getattr(request, f) not in (None, "", [])]
        if request.image_url:
            raise HTTPException(400, "image_url is not fetched by this server; send the image as base64 in 'image'")
        if len(given) != 1:
            raise HTTPException(400, "give exactly one of text, image or embedding_input")
        query = Query(
            text=request.text or None,
            image=decode(request.image, searcher) if request.image else None,
            embedding=request.embedding_input,
            k=request.num_images,
            modality=request.modality,
            dedup=DEDUP_THRESHOLD if request.deduplicate else None,
        )
        try:
            vector = searcher.query_vector(query)
            hits = searcher.search_vector(vector, query)
        except ValueError as err:
            raise HTTPException(400, str(err)) from err
        image_ids = [int(h.row["image_id"]) if request.modality == "text" else h.id for h in hits]
        images = searcher.index.rows("image", image_ids)
        base = str(http.base_url)
        results = []
        for hit, image_id, image in zip(hits, image_ids, images, strict=True):
            result: dict[str, Any] = {
                "id": hit.id,
                "similarity": round(hit.score, 6),
                "url": _url(image, name, indexes, image_id, base),
                "caption": hit.row.get("caption") or None,
            }
            if request.return_embeddings:
                stored = searcher.index.vector(request.modality, hit.id)
                result["embedding"] = [round(float(x), 7) for x in stored]
            results.append(result)
        headers = {}
        ignored = ignored_fields(request)
        if ignored:
            headers["X-Openalign-Ignored"] = ",".join(ignored)
        if request.return_embeddings:
            headers["X-Openalign-Query-Embedding"] = json.dumps([round(float(x), 7) for x in np.asarray(vector)])
        return JSONResponse(results, headers=headers)

    def metadata(request: MetadataRequest, http: Request) -> list[dict[str, Any]]:
        name, searcher = indexes.get(request.indice_name)
        size = searcher.index.size("image")
        bad = [i for i in request.ids if not 0 <= i < size]
        if bad:
            raise HTTPException(404, f"no image with id {bad[0]} in index {name!r} (it holds {size})")
        base = str(http.base_url)
        rows = searcher.index.rows("image", request.ids)
        return [
            {"id": i, "metadata": {"url": _url(row, name, indexes, i, base), "caption": row.get("caption") or None}}
            for i, row in zip(request.ids, rows, strict=True)
        ]

    responses = {200: {"model": list[KnnResult]}, **errors}
    app.router.add_api_route(
        "/knn-service", knn_service, methods=["POST"], response_model=None, responses=responses, **_ANY_CONTENT_TYPE
    )
    app.router.add_api_route(
        "/metadata", metadata, methods=["POST"], response_model=list[MetadataEntry], responses=errors,
        **_ANY_CONTENT_TYPE,
    )  # fmt: skip
