"""BERT-style WordPiece tokenisation with the paper's 64-token limit.

Files are the formats people already have: a Hugging Face ``tokenizer.json`` or a BERT ``vocab.txt``
(as in a transformers AlignModel directory), so a tokenizer trained here loads in transformers too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from openalign.data.sources import (
    SPECIAL_TOKENS_MAP,
    TOKENIZER_CONFIG,
    TOKENIZER_JSON,
    TOKENIZER_VOCAB_FILES,
    VOCAB_TXT,
    find_tokenizer_file,
)

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def _bert_pipeline(backend: Backend, lowercase: bool) -> Backend:
    backend.normalizer = normalizers.BertNormalizer(lowercase=lowercase, clean_text=True, handle_chinese_chars=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    cls, sep = backend.token_to_id("[CLS]"), backend.token_to_id("[SEP]")
    if cls is not None and sep is not None:
        backend.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
        )
    return backend


class TextTokenizer(Protocol):
    """What the library calls on a tokenizer, so embedding, evaluation, search and training accept any that
    has it (:class:`Tokenizer` is the one openalign ships): captions in, padded ``input_ids`` and
    ``attention_mask`` tensors out; the vocabulary size a model's token embeddings must cover; the length
    captions are cut to; and saving the files that load it again beside a checkpoint."""

    max_length: int  # wordpieces per caption, [CLS] and [SEP] included

    @property
    def vocab_size(self) -> int: ...

    def __call__(
        self, texts: str | list[str], max_length: int | None = None, pad_to_max: bool = True
    ) -> dict[str, torch.Tensor]:
        """``{"input_ids", "attention_mask"}``, each [len(texts), L] long: L is ``max_length`` (default
        ``self.max_length``), or the longest caption's length when ``pad_to_max`` is false."""
        ...

    def save(self, path: str | Path) -> Path:
        """Write the tokenizer's files into directory ``path``; returns it."""
        ...


class Tokenizer:
    """Turns captions into ``input_ids`` and ``attention_mask`` tensors of a fixed length (a :class:`TextTokenizer`)."""

    def __init__(self, backend: Backend, max_length: int = 64):
        self.backend = backend
        self.max_length = max_length
        ids = {token: backend.token_to_id(token) for token in ("[PAD]", "[CLS]", "[SEP]")}
        for token, id_ in ids.items():
            if id_ is None:
                raise ValueError(f"the vocabulary has no {token} token; it is not a BERT WordPiece vocabulary")
        self.pad_id: int = ids["[PAD]"] or 0

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __call__(
        self, texts: str | list[str], max_length: int | None = None, pad_to_max: bool = True
    ) -> dict[str, torch.Tensor]:
        """Tokenise, truncate to ``max_length`` (default 64) and pad with [PAD] to it (or to the longest)."""
        if isinstance(texts, str):
            texts = [texts]
        length = max_length or self.max_length
        encodings = self.backend.encode_batch([str(t) for t in texts])
        rows = []
        for enc in encodings:
            ids = enc.ids
            if len(ids) > length:
                # Keep the closing [SEP] so truncated captions look like complete ones to the encoder.
                ids = [*ids[: length - 1], ids[-1]]
            rows.append(ids)
        width = length if pad_to_max else max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, ids in enumerate(rows):
            input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, : len(ids)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.backend.decode(ids, skip_special_tokens=True)

    @property
    def lowercase(self) -> bool:
        """Whether the normaliser lowercases (and, as BERT's uncased models do, strips accents)."""
        return bool(getattr(self.backend.normalizer, "lowercase", True))

    def save(self, path: str | Path) -> Path:
        """Write ``tokenizer.json``, ``vocab.txt``, ``tokenizer_config.json`` and ``special_tokens_map.json``
        into directory ``path``: what transformers' ``BertTokenizerFast.from_pretrained`` reads."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(out / TOKENIZER_JSON))
        vocab = sorted(self.backend.get_vocab().items(), key=lambda kv: kv[1])
        (out / VOCAB_TXT).write_text("".join(token + "\n" for token, _ in vocab), encoding="utf-8")
        specials = {f"{name}_token": f"[{name.upper()}]" for name in ("unk", "sep", "pad", "cls", "mask")}
        # transformers rebuilds the normaliser from these flags, so they must match tokenizer.json exactly.
        config = {
            "tokenizer_class": "BertTokenizer",
            "do_lower_case": self.lowercase,
            "strip_accents": None,
            "tokenize_chinese_chars": True,
            "model_max_length": self.max_length,
            **specials,
        }
        (out / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        (out / SPECIAL_TOKENS_MAP).write_text(json.dumps(specials, indent=2) + "\n")
        return out


class IdTokenizer:
    """Captions in, one LongTensor out: the tokenizer shape open_clip and CLIP_benchmark call.

    ``tok(["a cat", "a dog"])`` is ``input_ids`` [B, max_length], each row [CLS] … [SEP] then [PAD] to the
    full length (longer captions cut, keeping [SEP]). There is no separate attention mask: a dual encoder's
    ``encode_text(ids)`` treats every [PAD] after the first position as padding, which is what the mask
    would have said. ``with_mask`` gives the ``{"input_ids", "attention_mask"}`` pair of :class:`Tokenizer`.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_id

    @property
    def max_length(self) -> int:
        return self.tokenizer.max_length

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def __call__(self, texts: str | list[str], context_length: int | None = None) -> torch.Tensor:
        """``input_ids`` [len(texts), context_length or max_length], padded with [PAD]."""
        return self.tokenizer(texts, max_length=context_length)["input_ids"]

    def with_mask(self, texts: str | list[str], context_length: int | None = None) -> dict[str, torch.Tensor]:
        return self.tokenizer(texts, max_length=context_length)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        return self.tokenizer.decode(ids)


def load_tokenizer(path: str | Path, max_length: int = 64) -> Tokenizer:
    """Load ``tokenizer.json`` or ``vocab.txt``, given as the file or a directory holding either
    (an openalign checkpoint, a vocabulary directory, or a transformers AlignModel directory)."""
    found = find_tokenizer_file(path)
    if found is None:
        if Path(path).is_dir():
            raise FileNotFoundError(f"{path}: no {' or '.join(TOKENIZER_VOCAB_FILES)} in this directory")
        raise FileNotFoundError(f"{path}: no such tokenizer file")
    p = found
    if p.suffix == ".json":
        return Tokenizer(Backend.from_file(str(p)), max_length)
    lowercase = True
    config = p.parent / TOKENIZER_CONFIG
    if config.is_file():
        from openalign.data.sources import read_annotation_json

        settings = read_annotation_json(config)
        lowercase = bool(settings.get("do_lower_case", True)) if isinstance(settings, dict) else True
    backend = Backend(models.WordPiece.from_file(str(p), unk_token="[UNK]"))
    return Tokenizer(_bert_pipeline(backend, lowercase), max_length)


def continuation_tokens(characters: Iterable[str], lowercase: bool = True) -> list[str]:
    """The ``##`` pieces that can stand for ``characters`` inside a word, after BERT normalisation, sorted.

    A character that the pre-tokeniser always splits off on its own (punctuation, CJK, white space) never
    continues a word, so it gets no ``##`` piece.
    """
    probe = Backend(models.WordPiece(unk_token="[UNK]"))
    probe.normalizer = normalizers.BertNormalizer(lowercase=lowercase, clean_text=True, handle_chinese_chars=True)
    probe.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    pieces: set[str] = set()
    for char in set(characters):
        words = probe.pre_tokenizer.pre_tokenize_str(probe.normalizer.normalize_str(f"a{char}a"))
        if len(words) == 1:
            pieces.update("##" + c for c in words[0][0][1:-1])
    return sorted(pieces)


def _characters(texts: Iterable[str] | Iterable[list[str]]) -> set[str]:
    chars: set[str] = set()
    for item in texts:
        if isinstance(item, str):
            chars.update(item)
        else:
            for text in item:
                chars.update(text)
    return chars


def train_wordpiece(
    texts: Iterable[str] | Iterable[list[str]],
    vocab_size: int = 100_000,
    lowercase: bool = True,
    min_frequency: int = 2,
    max_length: int = 64,
    characters: Iterable[str] | None = None,
) -> Tokenizer:
    """Learn a WordPiece vocabulary from captions (the paper: 100k pieces from its training data).

    ``texts`` is a sequence of captions or of caption batches (lists). The same text always gives the same
    vocabulary: HF's trainer numbers the ``##`` pieces in hash-map order and breaks ties between equally
    frequent merges by those numbers, so every ``##`` piece is numbered in sorted order before training
    (as special tokens of the trainer, made ordinary vocabulary entries afterwards). That needs the
    corpus' ``characters`` up front: pass them (any superset works) to stream ``texts`` once in constant
    memory; without them ``texts`` is read twice, or held in memory if it is a one-shot iterator.
    """
    if characters is None:
        if iter(texts) is texts:  # a generator cannot be read twice
            texts = list(texts)
        characters = _characters(texts)
    continuation = continuation_tokens(characters, lowercase)
    backend = Backend(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=lowercase, clean_text=True, handle_chinese_chars=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[*SPECIAL_TOKENS, *continuation],
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    # The ## pieces were special only to fix their numbers: keep them as ordinary pieces of the vocabulary.
    state = json.loads(backend.to_str())
    state["added_tokens"] = [t for t in state["added_tokens"] if t["content"] in SPECIAL_TOKENS]
    backend = Backend.from_str(json.dumps(state))
    return Tokenizer(_bert_pipeline(backend, lowercase), max_length)
