"""Settings of ``openalign shard`` (``openalign.data.shards.shard_input``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ShardConfig:
    """How inputs become WebDataset tars: the keyword arguments of ``shard_input`` (which checks them)."""

    samples_per_shard: int = 1000  # samples per tar
    max_side: int | None = None  # downscale so the longer side is at most this many px (default: keep)
    jpeg_quality: int = 95  # JPEG quality 1-100 of re-encoded images
    prefix: str = ""  # shard file name prefix, e.g. train-
    captions: str | None = None  # folder input: CSV/Parquet/JSONL of file name + caption (else sidecar .txt)
    # table input: folder that relative image_path values start from (default: the table's folder)
    image_root: str | None = None
    caption_column: str | None = None  # table input: caption column (default: caption, text, alt, ...)
    image_column: str | None = None  # table input: image-bytes column (default: jpg, image, image_bytes, ...)
    max_file_mb: float = 64.0  # larger image files (and shard members) are skipped unread as too_large_file
    # table input: also read image paths that resolve outside the image root (else skipped as outside_root)
    allow_outside_root: bool = False
