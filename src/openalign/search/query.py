"""Queries against an index: text → image, image → image, image → text, and image ± text arithmetic.

ALIGN's embeddings compose linearly (the paper's Figure 5): "a photo of black shoes" + "beige" finds
beige shoes of the same look, and subtracting "cars" from a street scene removes the cars. Following the
paper's footnote 4, every part is L2-normalised before it is added, and the text parts are weighted 2
against the image's 1 (its best; 1:1 "also works well"), then the sum is renormalised and searched.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from PIL import Image

from openalign.search.catalog import SearchIndex
from openalign.search.index import normalize_rows

if TYPE_CHECKING:
    from openalign.model.dual_encoder import DualEncoder
    from openalign.text.tokenizer import TextTokenizer

MAX_K = 1000


@dataclass
class Query:
    """What to look for. At least one of ``text``, ``image``, ``image_id``, ``embedding`` or ``plus`` must be
    given; ``embedding`` (a vector made elsewhere) takes the image's place in the sum."""

    text: str | None = None  # query by text (text → image, or text → text with modality text)
    image: Image.Image | None = None
    image_id: int | None = None  # query by an indexed image's stored embedding ("more like this")
    embedding: list[float] | None = None  # query by a vector of the index's width (normalised here)
    plus: list[str] = field(default_factory=list)  # texts added to the query
    minus: list[str] = field(default_factory=list)  # texts subtracted from it
    k: int = 10  # results, best first
    modality: Literal["image", "text"] = "image"  # search the image store or the caption store
    text_weight: float = 2.0  # weight of each text part of the sum (the paper's image ± text: 2)
    image_weight: float = 1.0  # weight of the image part (paper: 1)
    dedup: float | None = None  # drop results whose cosine to a better result exceeds this


@dataclass
class Hit:
    """One result: its id in the searched store, the cosine score, and its metadata row."""

    id: int
    score: float
    row: dict[str, Any]


def compose_query(
    image: np.ndarray | None = None,
    texts: Sequence[np.ndarray] = (),
    minus: Sequence[np.ndarray] = (),
    *,
    text_weight: float = 2.0,
    image_weight: float = 1.0,
) -> np.ndarray:
    """``normalise(image_weight·î + text_weight·Σ t̂ − text_weight·Σ m̂)`` where ^ is L2 normalisation.

    Raises ValueError when nothing positive is given or the parts cancel out.
    """
    if image is None and not texts:
        raise ValueError("a query needs text or an image; minus texts can only take something away")
    parts = []
    if image is not None:
        parts.append(image_weight * normalize_rows(np.asarray(image, np.float32).reshape(1, -1))[0])
    parts += [text_weight * normalize_rows(np.asarray(t, np.float32).reshape(1, -1))[0] for t in texts]
    parts += [-text_weight * normalize_rows(np.asarray(m, np.float32).reshape(1, -1))[0] for m in minus]
    total = np.sum(parts, axis=0)
    norm = float(np.linalg.norm(total))
    if norm < 1e-6:
        raise ValueError("the query's parts cancel out; change the weights or the minus texts")
    out: np.ndarray = (total / norm).astype(np.float32)
    return out


def remove_near_duplicates(ids: np.ndarray, vectors: np.ndarray, threshold: float) -> list[int]:
    """Positions of ``ids`` (best first) to keep so that no kept pair has cosine above ``threshold``.

    Greedy in rank order: a result survives unless it is a near copy of one already kept.
    """
    kept: list[int] = []
    kept_vecs: list[np.ndarray] = []
    for pos in range(len(ids)):
        v = vectors[pos]
        if kept_vecs and float(np.max(np.stack(kept_vecs) @ v)) > threshold:
            continue
        kept.append(pos)
        kept_vecs.append(v)
    return kept


def check_query(query: Query) -> None:
    """ValueError naming the problem, for a query that cannot be run."""
    if not isinstance(query.k, int) or isinstance(query.k, bool) or not 1 <= query.k <= MAX_K:
        raise ValueError(f"k must be an integer from 1 to {MAX_K}, got {query.k!r}")
    if query.modality not in ("image", "text"):
        raise ValueError(f"unknown modality {query.modality!r}; expected 'image' or 'text'")
    text = (query.text or "").strip()
    plus = [p for p in query.plus if p.strip()]
    if not text and query.image is None and query.image_id is None and query.embedding is None and not plus:
        raise ValueError("empty query: give text, an image, an image_id, an embedding or a plus text")
    if sum(x is not None for x in (query.image, query.image_id, query.embedding)) > 1:
        raise ValueError("give one of an image, an image_id or an embedding, not several")
    if query.embedding is not None:
        vector = np.asarray(query.embedding, dtype=np.float64)
        if vector.ndim != 1 or not len(vector) or not np.isfinite(vector).all() or not np.any(vector):
            raise ValueError("embedding must be a non-zero list of finite numbers")
    if query.dedup is not None and not 0.0 < query.dedup <= 1.0:
        raise ValueError(f"dedup must be a cosine threshold in (0, 1], got {query.dedup}")
    for name in ("text_weight", "image_weight"):
        value = getattr(query, name)
        if not np.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number ≥ 0, got {value}")


class Searcher:
    """Embeds queries with the index's model and searches an opened index.

    Text embeddings are cached (least recently used), since the same words come back again and again
    in a search box; the model runs under a lock so concurrent requests do not fight over the CPU.
    """

    def __init__(
        self,
        index: SearchIndex,
        model: DualEncoder | None = None,
        tokenizer: TextTokenizer | None = None,
        *,
        device: str = "cpu",
        cache_size: int = 4096,
        model_name: str | None = None,
    ):
        if model is not None and model.embed_dim != index.embed_dim:
            raise ValueError(f"the model makes {model.embed_dim}-d embeddings but the index holds {index.embed_dim}-d")
        self.index = index
        self.model = model.eval() if model is not None else None
        self.tokenizer = tokenizer
        # What /health reports as served: the model given here, else the one the index was built with.
        self.model_name = model_name or (index.info.get("model") if model is not None else None)
        self.device = device
        self.cache_size = cache_size
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def reopened(self) -> Searcher:
        """A searcher over the index as it now is on disk (grown by ``index build``), sharing this one's model,
        tokenizer and text cache; ValueError when the index no longer fits them (another width or model)."""
        import copy

        index = SearchIndex.open(self.index.root)
        if index.embed_dim != self.index.embed_dim or index.info.get("fingerprint") != self.index.info.get(
            "fingerprint"
        ):
            raise ValueError(
                f"{self.index.root / 'index.json'} now describes an index built by another model; restart the "
                "server to serve it"
            )
        fresh = copy.copy(self)
        fresh.index = index
        return fresh

    def _no_model(self, what: str) -> str:
        return (
            f"{what} queries need a model, and this index has none attached (it was built from embeddings); "
            f"pass --model with a model that makes {self.index.embed_dim}-d embeddings, or query with an embedding"
        )

    def _text_model(self) -> tuple[DualEncoder, TextTokenizer]:
        if self.model is None:
            raise ValueError(self._no_model("text"))
        if self.tokenizer is None:
            raise ValueError("text queries need the model's tokenizer; pass --tokenizer")
        return self.model, self.tokenizer

    def _image_model(self) -> DualEncoder:
        if self.model is None:
            raise ValueError(self._no_model("image"))
        return self.model

    def embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        """Normalised embeddings [len(texts), D] of the texts, cached."""
        model, tokenizer = self._text_model()
        from openalign.embed import embed_texts

        with self._lock:
            missing = [t for t in dict.fromkeys(texts) if t not in self._cache]
            if missing:
                emb = embed_texts(model, tokenizer, missing, device=self.device).numpy()
                for t, e in zip(missing, emb, strict=True):
                    self._cache[t] = e
            out = np.stack([self._cache[t] for t in texts]) if texts else np.zeros((0, self.index.embed_dim))
            for t in texts:
                self._cache.move_to_end(t)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return out.astype(np.float32)

    def embed_image(self, image: Image.Image) -> np.ndarray:
        """Normalised embedding [D] of one image."""
        model = self._image_model()
        from openalign.embed import embed_images

        with self._lock:
            emb: np.ndarray = embed_images(model, [image.convert("RGB")], device=self.device).numpy()[0]
        return emb

    def query_vector(self, query: Query) -> np.ndarray:
        """The normalised vector that ``query`` searches with."""
        check_query(query)
        texts = [t for t in [query.text or "", *query.plus] if t.strip()]
        minus = [t for t in query.minus if t.strip()]
        all_texts = texts + minus
        emb = self.embed_texts(all_texts) if all_texts else np.zeros((0, self.index.embed_dim), np.float32)
        image = None
        if query.embedding is not None:
            vector = np.asarray(query.embedding, dtype=np.float64)
            # Scaled before the float32 cast, so that a vector of huge (finite) numbers keeps its direction.
            image = (vector / np.abs(vector).max()).astype(np.float32)
            if image.shape != (self.index.embed_dim,):
                raise ValueError(
                    f"the embedding has {image.size} numbers; this index holds {self.index.embed_dim}-d vectors"
                )
        elif query.image is not None:
            image = self.embed_image(query.image)
        elif query.image_id is not None:
            try:
                image = self.index.vector("image", query.image_id)
            except KeyError as err:
                raise ValueError(str(err.args[0])) from err
        return compose_query(
            image,
            list(emb[: len(texts)]),
            list(emb[len(texts) :]),
            text_weight=query.text_weight,
            image_weight=query.image_weight,
        )

    def search(self, query: Query) -> list[Hit]:
        """The top ``query.k`` hits, best first."""
        return self.search_vector(self.query_vector(query), query)

    def search_vector(self, vector: np.ndarray, query: Query) -> list[Hit]:
        """The top ``query.k`` hits for ``vector`` (``query_vector(query)``) in ``query.modality``, with
        ``query.dedup``, best first."""
        store = self.index.store(query.modality)
        depth = query.k if query.dedup is None else min(MAX_K * 4, query.k * 4)
        scores, ids = store.search(vector[None], depth)
        scores, ids = scores[0], ids[0]
        valid = ids >= 0
        scores, ids = scores[valid], ids[valid]
        if query.dedup is not None and len(ids):
            vecs = np.asarray(store.vectors[np.sort(ids)], dtype=np.float32)
            vecs = vecs[np.searchsorted(np.sort(ids), ids)]
            keep = remove_near_duplicates(ids, vecs, query.dedup)
            scores, ids = scores[keep], ids[keep]
        scores, ids = scores[: query.k], ids[: query.k]
        rows = self.index.rows(query.modality, ids)
        return [Hit(int(i), float(s), row) for i, s, row in zip(ids, scores, rows, strict=True)]
