"""Which model built an index: a fingerprint of its weights and tokenizer, recorded in ``index.json``.

Rankings of query embeddings made by another model against an index's vectors are meaningless even when the
widths agree, so ``search`` and ``serve`` compare the model they load with the one the index records. The
weights' fingerprint is a SHA-256 over the state dict's names, dtypes, shapes and bytes (the same for an
openalign directory and the transformers directory it was converted to); the tokenizer's is a SHA-256 over its
vocabulary and lower-casing. An index built before fingerprints were recorded opens with a warning.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from openalign.config import ConfigError

if TYPE_CHECKING:
    from openalign.model.dual_encoder import DualEncoder
    from openalign.text.tokenizer import TextTokenizer

FINGERPRINT = "fingerprint"  # the index.json key: {"weights": sha256, "tokenizer": sha256 or null}


def weights_sha256(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}:{data.dtype}:{list(tensor.shape)};".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def tokenizer_sha256(tokenizer: TextTokenizer | None) -> str | None:
    """The vocabulary's fingerprint, or None for a tokenizer that does not show its vocabulary."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "get_vocab"):
        return None
    vocab = sorted(backend.get_vocab().items(), key=lambda kv: kv[1])
    text = json.dumps({"vocab": vocab, "lowercase": getattr(tokenizer, "lowercase", None)}, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint(model: DualEncoder, tokenizer: TextTokenizer | None) -> dict[str, str | None]:
    return {"weights": weights_sha256(model), "tokenizer": tokenizer_sha256(tokenizer)}


def check_same_model(
    index_info: dict[str, Any],
    index_path: str | Path,
    model_name: str,
    found: dict[str, str | None],
    *,
    allow_other_model: bool = False,
) -> None:
    """A one-line ConfigError when ``found`` (the loaded model's fingerprint) is not the one ``index_info``
    records, unless ``allow_other_model``; a warning on stderr when the index records none."""
    info_file = Path(index_path) / "index.json"
    recorded = index_info.get(FINGERPRINT)
    if not isinstance(recorded, dict):
        print(
            f"warning: {info_file} records no fingerprint of the model that built it (built before openalign "
            f"recorded one), so it cannot be checked that {model_name} made its embeddings",
            file=sys.stderr,
        )
        return
    if allow_other_model:
        return
    built_with = index_info.get("model") or "another model"
    for part, what in (("weights", "weights"), ("tokenizer", "tokenizer")):
        want, got = recorded.get(part), found.get(part)
        if want and got and want != got:
            raise ConfigError(
                f"{info_file}: the index was built by {built_with} ({what} sha256 {want[:12]}…), but {model_name} "
                f"has {what} sha256 {got[:12]}…; its rankings would be meaningless. Search with the model that "
                "built the index, or pass --allow-other-model"
            )
