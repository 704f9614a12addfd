"""What the image rules need from the images themselves: the encoding format and the image's tags.

Both are worked out once, while staging, into hidden columns of the staged table, so the DuckDB and Spark
engines read the same values and only compare them:

* ``__oa_image_format``: the input's format column normalised (``image/jpeg`` -> ``jpeg``), or, without
  one, the format sniffed from the image's first bytes (:func:`openalign.data.sources.sniff_image_format`),
  never the file name;
* ``__oa_tag_words``: the distinct words (rules.tokenize) of the image's tags, space-separated, from the
  input's tags column or from an :data:`ImageTagger` given to the run (the model-backed one lives in
  ``openalign.pipeline.tagging``, since a model is above this layer).

Images are read through :mod:`openalign.data.sources` with its size cap: a shard's image member, a table's
image-bytes column, or its ``image_path`` file (kept inside the table's folder). An image that cannot be
read has no format and no tags, and its reason goes to the report's input errors.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from openalign.data.filters.rules import ColumnNames, normalise_format, tokenize

if TYPE_CHECKING:
    from openalign.data.sources import ImageRoot

IMAGE_FORMAT_COLUMN = "__oa_image_format"
TAG_WORDS_COLUMN = "__oa_tag_words"
HIDDEN_PREFIX = "__oa_"
# Encoded images in, tags out (None: the image could not be tagged); one list per image, best first.
ImageTagger = Callable[[Sequence[bytes | None]], list[list[str] | None]]
_BATCH_ROWS = 1024


def tag_words(tags: Any) -> str | None:
    """The distinct words of ``tags`` (a list of tags, a JSON list, or a string split at , ; |), in order."""
    if tags is None:
        return None
    if isinstance(tags, str):
        text = tags.strip()
        if text.startswith("["):
            with contextlib.suppress(ValueError):
                tags = json.loads(text)
        if isinstance(tags, str):
            tags = text.replace(";", ",").replace("|", ",").split(",")
    words: dict[str, None] = {}
    for tag in tags:
        if tag is not None:
            words.update(dict.fromkeys(tokenize(str(tag))))
    return " ".join(words)


@dataclass
class ImageAnnotator:
    """Computes the hidden columns for a batch of rows: which ones, and from what, is decided once."""

    formats: bool  # the image_format rule is on
    tags: bool  # the tag_overlap rule is on
    format_column: str | None  # the input's format column, when it has one
    tags_column: str | None  # the input's tags column, when it has one (a tagger takes precedence)
    tagger: ImageTagger | None = None

    @property
    def needs_images(self) -> bool:
        return (self.formats and self.format_column is None) or (self.tags and self.tagger is not None)

    @property
    def needs_whole_images(self) -> bool:
        return self.tags and self.tagger is not None

    @property
    def columns(self) -> list[str]:
        return [IMAGE_FORMAT_COLUMN] * self.formats + [TAG_WORDS_COLUMN] * self.has_tags

    @property
    def has_tags(self) -> bool:
        return self.tags and (self.tagger is not None or self.tags_column is not None)

    def __call__(
        self, images: Sequence[bytes | None], formats: Sequence[Any] | None, tags: Sequence[Any] | None
    ) -> dict[str, list[str | None]]:
        from openalign.data.sources import sniff_image_format

        out: dict[str, list[str | None]] = {}
        if self.formats:
            if formats is not None:
                out[IMAGE_FORMAT_COLUMN] = [normalise_format(v) for v in formats]
            else:
                out[IMAGE_FORMAT_COLUMN] = [None if b is None else sniff_image_format(b) for b in images]
        if self.has_tags:
            if self.tagger is not None:
                found = self.tagger(list(images))
                if len(found) != len(images):
                    raise RuntimeError(f"the image tagger returned {len(found)} results for {len(images)} images")
                out[TAG_WORDS_COLUMN] = [tag_words(t) for t in found]
            else:
                out[TAG_WORDS_COLUMN] = [tag_words(v) for v in tags or [None] * len(images)]
        return out


def make_annotator(
    columns: ColumnNames,
    present: Sequence[str],
    rules: Any,
    tagger: ImageTagger | None,
    images_present: bool = False,
) -> ImageAnnotator:
    """The annotator for an input with columns ``present`` under ``rules``. Without a format column the
    format comes from the images, and without images (no bytes column, no ``image_path``, not shards;
    ``images_present`` says the input carries them anyway) the rule has nothing to read: the plan skips it."""
    from openalign.data.sources import IMAGE_BYTES_COLUMNS, IMAGE_PATH_COLUMN

    images = images_present or IMAGE_PATH_COLUMN in present or any(c in present for c in IMAGE_BYTES_COLUMNS)
    format_column = columns.image_format if columns.image_format in present else None
    tags_column = columns.tags if columns.tags in present else None
    return ImageAnnotator(
        formats=rules.image_formats is not None and (format_column is not None or images),
        tags=rules.min_tag_overlap is not None and (tags_column is not None or (images and tagger is not None)),
        format_column=format_column,
        tags_column=tags_column,
        tagger=tagger if images else None,
    )


def _row_image(
    row: dict[str, Any], bytes_columns: list[str], root: ImageRoot, whole: bool, max_bytes: int, errors: list[str]
) -> bytes | None:
    """A table row's image (whole, or only its head when the format is all that is needed)."""
    from openalign.data.sources import (
        IMAGE_HEAD_BYTES,
        IMAGE_PATH_COLUMN,
        BadInput,
        read_file,
        read_file_head,
    )

    for column in bytes_columns:
        value = row.get(column)
        if isinstance(value, dict):  # datasets' Image feature: {"bytes": ..., "path": ...}
            value = value.get("bytes")
        if isinstance(value, bytes):
            return value
    if row.get(IMAGE_PATH_COLUMN):
        try:
            path = root.resolve(str(row[IMAGE_PATH_COLUMN]))
            return read_file(path, max_bytes=max_bytes) if whole else read_file_head(path, IMAGE_HEAD_BYTES)
        except BadInput as err:
            errors.append(f"{err.reason}: {err.detail}")
    return None


def annotate_table(
    paths: Sequence[Path],
    names: list[str],
    annotator: ImageAnnotator,
    image_root: Path,
    out: Path,
    max_bytes: int,
    errors: list[str],
) -> Path:
    """Copy the staged Parquet ``paths`` (columns ``names``) to ``out`` with the annotator's hidden columns."""
    from openalign.data.sources import IMAGE_BYTES_COLUMNS, IMAGE_PATH_COLUMN, ImageRoot

    schema = pa.unify_schemas([pq.read_schema(p) for p in paths], promote_options="permissive")
    schema = pa.schema([schema.field(n) if n in schema.names else pa.field(n, pa.null()) for n in names])
    bytes_columns = [c for c in IMAGE_BYTES_COLUMNS if c in names]
    if annotator.needs_images and not bytes_columns and IMAGE_PATH_COLUMN not in names:
        raise ValueError(
            "the image rules need the images: the input has no format column, no image-bytes column "
            f"({', '.join(IMAGE_BYTES_COLUMNS)}) and no {IMAGE_PATH_COLUMN} column"
        )
    hidden = [pa.field(c, pa.string()) for c in annotator.columns]
    writer = pq.ParquetWriter(out, pa.schema([*schema, *hidden]))
    root = ImageRoot(image_root)
    try:
        for p in paths:
            for batch in pq.ParquetFile(p).iter_batches(batch_size=_BATCH_ROWS):
                table = pa.Table.from_batches([batch])
                for name in names:
                    if name not in table.column_names:
                        table = table.append_column(name, pa.nulls(len(table), schema.field(name).type))
                table = table.select(names).cast(schema)
                images: list[bytes | None] = [None] * len(table)
                if annotator.needs_images:
                    rows = table.select([c for c in [*bytes_columns, IMAGE_PATH_COLUMN] if c in names]).to_pylist()
                    whole = annotator.needs_whole_images
                    images = [_row_image(r, bytes_columns, root, whole, max_bytes, errors) for r in rows]
                fmt = annotator.format_column
                formats = table.column(fmt).to_pylist() if fmt is not None else None
                tags = table.column(annotator.tags_column).to_pylist() if annotator.tags_column else None
                for name, values in annotator(images, formats, tags).items():
                    table = table.append_column(name, pa.array(values, pa.string()))
                writer.write_table(table)
    finally:
        writer.close()
    return out
