"""The training input stream: WebDataset shards (or the synthetic world) → decoded, augmented, tokenised batches.

Sample order. With ``resampled: false`` (the default) every rank sees one *global* sequence of samples that
does not depend on the world size or on the number of DataLoader workers: epoch ``e`` reads the shards in a
permutation seeded by ``(seed, e)`` through a shuffle buffer seeded by ``(seed, e)``, and epochs follow one
another. Step ``s`` consumes the next ``world_size × batch_size`` samples of that sequence; rank ``r`` takes
samples ``r, r + W, r + 2W, …`` of them. A rank's batch is cut into pieces of ``data.piece_size`` samples, and
piece ``q`` of step ``s`` is built by worker ``(s × pieces per batch + q) mod workers``. The stream
position is therefore one number, the samples consumed globally, and resuming on another world size (or
with another batch split) continues at exactly the right sample. Augmentation draws from a generator
seeded by ``(seed, sample index)``, so a sample's crop and flip do not depend on who decodes it either.

The price of that exactness is reading: every worker of every rank walks every tar, and resuming
fast-forwards through the current epoch without decoding. A plain local tar is walked from its member headers
(``openalign.data.tar_index``): a worker reads the captions and the first bytes of each image, whose size it
takes from the JPEG header without PIL, and reads whole only the images it decodes; other shards (compressed,
piped, damaged) are read whole by every worker. That is cheap on local disks for a few nodes; for many nodes
use ``resampled: true``:
each worker then draws shards with replacement from its own generator (seeded by rank, worker and the
position at which it started), reads only those, and a resumed run continues with fresh draws rather
than the exact next samples.

Memory. Workers hand over pieces, never whole batches, and pixels stay uint8 until the device: the training
process assembles a rank's batch from its pieces, the loop copies it to the device as uint8, and the model's
input (float, normalised) is made there chunk by chunk (``TrainStream.pixels``). The pieces in flight between the
workers and the training process are bounded by ``data.prefetch_gb``, whatever the batch or the number of workers;
a budget too small to hold one batch is refused when the stream is built. So the host holds at most the budget
plus the batch being assembled and the one in use, each ``batch × 3 × size²`` bytes (4.1 GB for the paper's
16,384 pairs at 289 px). With ``pin_memory`` (by default on CUDA, for batches of up to ``PIN_LIMIT``) a thread of
the training process assembles the next batch, in page-locked memory, while the step runs: the loop then neither
waits for the pieces nor, copying a page-locked batch, for the GPU's queued work (a copy from pageable memory may
wait for it); one batch more.

GPU decoding. With ``decode: cuda`` a worker decodes nothing it can leave to the GPU: for a JPEG it checks the
header as above, draws the crop box and flip from the sample's seed exactly as the CPU transform draws them, and
hands over the encoded bytes with them; the training process decodes each piece on its device
(``openalign.data.device_decode``) into a batch that is already there. Other images (PNG, CMYK JPEGs, a JPEG
without its end marker) are decoded by the worker as with ``decode: cpu``, refills included. A JPEG that only the
device finds broken is counted ``corrupt`` and its row repeats another of its piece.

Bad input. A sample is dropped from the global sequence before it gets an index when it is missing its
image or its text, its caption is empty or not UTF-8, or its image header shows it is empty, unreadable,
too large (decompression bombs are caught from the header) or too small; an unreadable shard or member is
dropped the same way. These checks need no pixel decoding, so every reader agrees on the sequence. An image
whose header is fine but whose data is broken (a truncated file) is found only by its decoder, after the
sample has its place: its slot is refilled with a sample from before the current step (a repeat, never an
in-batch duplicate) so batches keep their exact size and the position stays exact. Every skip is counted by
reason in ``TrainStream.stats``, each exactly once across ranks and workers (the rank and worker that own
the skipped sample's position count it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import itertools
import json
import math
import os
import queue
import random
import sys
import threading
import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import numpy as np
import torch
from PIL import Image

from openalign.config import ConfigError, ModelConfig
from openalign.data.sources import (
    CAPTION_MEMBER,
    IMAGE_MEMBERS,
    METADATA_MEMBER,
    expand_urls,
    file_limit,
    image_member,
    is_remote,
    read_samples,
)
from openalign.data.tar_index import MemberRef, TarWindow, index_samples
from openalign.data.transforms import jpeg_size

if TYPE_CHECKING:
    from openalign.data.device_decode import DeviceDecoder
    from openalign.text.tokenizer import TextTokenizer

__all__ = ["DataConfig", "SyntheticDataConfig", "TrainSource", "TrainStream", "build_train_stream", "reduce_stats"]

# Distinct streams of randomness derived from one seed.
_TAG_SHARD_ORDER, _TAG_BUFFER, _TAG_AUGMENT, _TAG_REFILL, _TAG_RESAMPLE = 1, 2, 3, 4, 5
# Samples just before a step, per piece of it, that may refill the slot of an image found broken only when decoded.
_REFILL_POOL = 8
GB = 10**9
# Bytes of an image read to find its size from the header; a JPEG whose header runs longer (a large EXIF or ICC
# block) is read whole and asked of PIL.
_PROBE_HEAD = 1 << 14
# With data.cache_mb, the share of it that a source may give to the records of the shards it has read (captions
# and where each image lies), replayed on later epochs. A record takes ~2 % of what its decoded image takes in the
# cache at 67 px (300 bytes against 13 kB), so the records of every image the rest holds fit in it.
_RECORDS_SHARE = 1 / 32
_RECORD_BYTES = 200  # a record's tuple and MemberRef beside its caption string, as sys.getsizeof counts them


@dataclass
class SyntheticDataConfig:
    """The procedural noisy alt-text world (``openalign.data.synthetic``) as a training source."""

    noise: float = 0.25  # fraction of captions replaced by alt-text noise of the paper's kinds; 0 = clean
    image_size: int = 64  # rendered scene size in pixels (then resized and cropped like any image)
    size: int | None = None  # scenes per epoch, repeated every epoch; None = an endless stream of new scenes
    languages: tuple[str, ...] = ("en",)  # caption languages, one per row drawn from the seed (en, de, fr, cs)


@dataclass
class DataConfig:
    """Where training pairs come from and how they become batches. ``None`` sizes come from the model."""

    source: Literal["shards", "synthetic"] = "shards"
    shards: str | tuple[str, ...] = ""  # brace pattern, glob, directory or list of tar paths (img2dataset layout)
    tokenizer: str = ""  # tokenizer.json / vocab.txt or a directory holding one (from `openalign vocab`)
    batch_size: int = 256  # per rank
    image_size: int | None = None  # crop size; None = the model's image_size (the paper: 289)
    resize: int | None = None  # square resize before cropping; None = image_size × 346 / 289
    crop: Literal["random", "center"] = "random"  # the paper trains on random crops
    flip: bool = True  # random horizontal flip (with random crops)
    pixel_mean: tuple[float, float, float] | None = None  # None = the model's (0.5: pixels in [-1, 1])
    pixel_std: tuple[float, float, float] | None = None
    max_text_length: int = 64  # wordpieces per caption, [CLS] and [SEP] included (the paper: 64)
    caption_key: str = CAPTION_MEMBER  # tar member holding the caption, or "json:<field>" for a field of key.json
    image_keys: tuple[str, ...] = IMAGE_MEMBERS  # the first member present is the image (data/sources.py)
    shuffle_buffer: int = 1000  # samples mixed across shards; 0 or 1 keeps the reading order
    shuffle_shards: bool = True  # a new shard order every epoch
    resampled: bool = False  # draw shards with replacement per worker (multi-node); position then approximate
    workers: int = 2  # DataLoader processes decoding per rank; 0 decodes in the training process
    piece_size: int = 256  # samples a worker decodes and hands over at once (at most the per-rank batch)
    prefetch_gb: float = 8.0  # host memory for decoded pieces in flight, all workers together; holds ≥ one batch
    # What each reader keeps from epoch to epoch, in MB: decoded images, resized but not yet cropped, and their
    # captions' token rows; a 32nd of it for the local shards' records (captions, where each image lies). Later
    # epochs of a dataset that fits skip reading the shards, decoding, resizing and tokenising, and only crop (the
    # same batches). Pays with one reader per rank (workers 0 or 1): with more, a sample's reader changes from epoch
    # to epoch. 0 = off; with decode: cuda only the records are kept.
    cache_mb: float = 0.0
    # Assemble batches in page-locked memory, in a thread of the training process while the step runs, so the copy
    # to the GPU neither waits for the step before it nor for the pieces; None = on when training on CUDA with
    # batches of at most 256 MiB of pixels (a page-locked block is a power of two: a larger batch would waste up
    # to half of its own size, for a copy that is then a small part of its step)
    pin_memory: bool | None = None
    draft: bool = True  # decode JPEGs ≥ 2× the resize at 1/2, 1/4 or 1/8 scale (PIL draft mode), then resize
    # cuda: workers read JPEG headers and draw crops; the training process decodes, crops, resizes and flips on its
    # GPU (torchvision); other formats are decoded by the workers as with cpu (draft mode then applies to those)
    decode: Literal["cpu", "cuda"] = "cpu"
    seed: int | None = None  # None = the run's seed
    max_pixels: int = 64_000_000  # larger images are skipped from their header (decompression-bomb guard)
    min_side: int = 2  # images with a shorter side are skipped
    max_file_mb: float = 64.0  # larger shard members are skipped unread (counted as shard_too_large_member)
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)

    def validate(self) -> None:
        """Cross-field checks; raises ConfigError naming the field."""
        if self.source == "shards" and not self.shards:
            raise ConfigError("data.shards must name the training shards when data.source is 'shards'")
        for name in ("batch_size", "max_text_length", "piece_size", "max_pixels", "min_side"):
            if getattr(self, name) < 1:
                raise ConfigError(f"data.{name} must be at least 1, got {getattr(self, name)}")
        try:
            file_limit(self.max_file_mb)
        except ValueError as err:
            raise ConfigError(f"data.{err}") from None
        if self.max_text_length < 2:
            raise ConfigError(f"data.max_text_length must leave room for [CLS] and [SEP], got {self.max_text_length}")
        if not self.prefetch_gb > 0:
            raise ConfigError(f"data.prefetch_gb must be positive, got {self.prefetch_gb}")
        if not 0 <= self.cache_mb < math.inf:
            raise ConfigError(f"data.cache_mb must be finite and not negative, got {self.cache_mb}")
        if self.workers < 0 or self.shuffle_buffer < 0:
            raise ConfigError("data.workers and data.shuffle_buffer must not be negative")
        if self.image_size is not None and self.image_size < 8:
            raise ConfigError(f"data.image_size must be at least 8 pixels, got {self.image_size}")
        if self.resize is not None and self.image_size is not None and self.resize < self.image_size:
            raise ConfigError(f"data.resize {self.resize} is smaller than data.image_size {self.image_size}")
        if self.pixel_std is not None and any(s <= 0 for s in self.pixel_std):
            raise ConfigError(f"data.pixel_std must be positive, got {list(self.pixel_std)}")
        if not self.image_keys:
            raise ConfigError("data.image_keys must name at least one image extension")
        if self.decode == "cuda" and self.source != "shards":
            raise ConfigError(
                "data.decode: cuda decodes the JPEGs of shards; the synthetic world renders its images "
                "(use data.decode: cpu)"
            )
        if self.caption_key.startswith("json:") and not self.caption_key[5:]:
            raise ConfigError("data.caption_key 'json:' needs a field name, e.g. 'json:caption'")
        syn = self.synthetic
        if not 0.0 <= syn.noise <= 1.0:
            raise ConfigError(f"data.synthetic.noise must be in [0, 1], got {syn.noise}")
        if syn.image_size < 8 or (syn.size is not None and syn.size < 1):
            raise ConfigError("data.synthetic.image_size must be ≥ 8 and data.synthetic.size ≥ 1 (or null)")
        from openalign.data.synthetic import check_languages

        try:
            check_languages(syn.languages)
        except ValueError as err:
            raise ConfigError(f"data.synthetic.languages: {err}") from None


# --------------------------------------------------------------------------------------------------
# Helpers


def _mix(*values: int) -> int:
    """A 63-bit seed from several non-negative integers, stable across processes and Python versions."""
    return int(np.random.SeedSequence([int(v) for v in values]).generate_state(1, np.uint64)[0] >> 1)


class _ShuffleBuffer:
    """Reservoir-style shuffling of a stream: each new item replaces a random one, which is emitted."""

    def __init__(self, size: int, rng: random.Random):
        self.size, self.rng = size, rng
        self.items: list[Any] = []

    def push(self, item: Any) -> Any | None:
        if self.size <= 1:
            return item
        if len(self.items) < self.size:
            self.items.append(item)
            return None
        j = self.rng.randrange(self.size)
        out, self.items[j] = self.items[j], item
        return out

    def drain(self) -> Iterator[Any]:
        self.rng.shuffle(self.items)
        items, self.items = self.items, []
        yield from items


def probe_image(data: bytes, *, max_pixels: int, min_side: int) -> str | None:
    """The reason an encoded image is unusable, judged from its header alone, or None if it may be fine.

    Agrees with ``decode_image``'s reasons; broken pixel data behind a good header is found only by decoding.
    """
    if not data:
        return "empty"
    size = jpeg_size(data)  # most web images: their size without PIL
    if size is None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(data)) as image:
                    size = image.size
        except Image.DecompressionBombError:
            return "too_large"
        except Exception:  # PIL raises many types (OSError, SyntaxError, ValueError...) for unreadable headers
            return "corrupt"
    return _size_reason(size, max_pixels=max_pixels, min_side=min_side)


def _size_reason(size: tuple[int, int], *, max_pixels: int, min_side: int) -> str | None:
    width, height = size
    if width * height > max_pixels:
        return "too_large"
    if min(width, height) < min_side:
        return "too_small"
    return None


def _caption(sample: dict, key: str) -> str:
    """The caption of a shard sample, or raise _Skip with the reason it is unusable."""
    if key.startswith("json:"):
        raw_json = sample.get(METADATA_MEMBER)
        if raw_json is None:
            raise _Skip("missing_text")
        try:
            value = json.loads(raw_json).get(key[5:])
        except (ValueError, AttributeError) as err:
            raise _Skip("bad_json") from err
        if value is None:
            raise _Skip("missing_text")
        text = str(value)
    else:
        raw = sample.get(key)
        if raw is None:
            raise _Skip("missing_text")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise _Skip("caption_not_utf8") from err
    text = text.strip()
    if not text:
        raise _Skip("caption_empty")
    return text


class _Skip(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# A shard source reads, per epoch or per resampled draw, either a usable record (caption, image) — the image as
# encoded bytes or a PIL image — or a string: the reason one sample (or a whole shard) was dropped.
Record = tuple[str, Any]
Event = Record | str
# An entry of the global sample sequence, (is_item, position, payload): a usable sample at its global position,
# its payload what the source's ``materialize`` makes a Record of; or (is_item false) the reason a sample was
# dropped, placed at the position of the usable sample read just before it.
Entry = tuple[bool, int, Any]
# A resampled draw: (the sample's augmentation seed, its payload), or the reason a sample was dropped.
Draw = tuple[int, Any] | str


class TrainSource(Protocol):
    """Where training samples come from, as a reader sees it: the source decides the order of the samples and
    what stands for one until it is needed; the reader decodes, augments, batches and counts skips.

    A payload is cheap to pass around (a shard sample's bytes, a synthetic row's index) and becomes a
    (caption, image) record only in the reader that owns its position, so readers never render or decode
    samples that belong to another rank or worker.
    """

    def fingerprint(self) -> str:
        """What decides the sample sequence: a resumed run reuses a stored epoch length only when this matches."""
        ...

    def describe(self) -> str:
        """The source in a few words, for error messages."""
        ...

    def sequence(
        self, seed: int, start: int, epoch_length: int | None, on_epoch: Callable[[int], None]
    ) -> Iterator[Entry]:
        """The global sequence (``resampled: false``) from position ``start`` on. ``epoch_length``, when known,
        lets the source pass over whole epochs before ``start`` without reading them; ``on_epoch`` is told the
        usable samples of every epoch read to its end."""
        ...

    def draws(self, run_seed: int, seed: int) -> Iterator[Draw]:
        """Endless draws with replacement (``resampled: true``) from the generator seeded by ``seed``."""
        ...

    def materialize(self, payload: Any) -> Record:
        """The (caption, image) record of a payload from ``sequence`` or ``draws``."""
        ...

    def cache_key(self, payload: Any) -> Any:
        """What identifies a payload's sample from epoch to epoch (hashable), for a reader's cache of decoded
        images (``data.cache_mb``); None where nothing does, and the sample is decoded every time."""
        ...


class _ShardSource:
    """WebDataset shards (read by ``openalign.data.sources``), in a seeded shard order per epoch through a
    seeded shuffle buffer. Every reader reads every sample, so a drop is known to all of them alike.

    A plain local tar is read from its headers (``openalign.data.tar_index``): a record then holds the place of
    its image, whose first bytes alone are read to probe it, and ``materialize`` reads the rest only for the
    reader that decodes it. Every reader still walks every sample, but that walk does not read or probe
    other readers' images through PIL, so its cost stays small beside a decode however many workers there are.
    """

    def __init__(self, urls: list[str], cfg: DataConfig):
        self.urls, self.cfg = urls, cfg
        # A local tar's events from its first whole read, replayed on later epochs while they fit: once the images
        # are cached (data.cache_mb), reading every header, caption and image head again would be a large share of a
        # reader's work a batch.
        self._records: dict[str, list[Event]] = {}
        self._records_room = int(cfg.cache_mb * 2**20 * _RECORDS_SHARE)

    def fingerprint(self) -> str:
        c = self.cfg
        limits = [c.max_pixels, c.min_side, c.max_file_mb]
        return json.dumps(["shards", self.urls, c.caption_key, list(c.image_keys), *limits])

    def describe(self) -> str:
        urls = self.urls
        return f"{len(urls)} shard(s) ({urls[0]}{', …' if len(urls) > 1 else ''})"

    def recorded_samples(self, enough: int) -> int | None:
        """The samples the shards' own records say they hold, summed until the sum reaches ``enough``: each
        local tar's ``{name}_stats.json`` (``successes``, as ``openalign shard`` and img2dataset write it), else
        its ``{name}.parquet`` (one row a sample). None when some shard has neither, or is remote."""
        from openalign.data.shards import shard_samples

        total = 0
        for url in self.urls:
            if total >= enough:
                break
            if is_remote(url) or not url.endswith(".tar"):
                return None
            count = shard_samples(url.removeprefix("file://"))
            if count is None:
                return None
            total += count
        return total

    def read(self, url: str) -> Iterator[Event]:
        kept = self._records.get(url)
        if kept is not None:
            yield from kept
            return
        indexed = index_samples(url, file_limit(self.cfg.max_file_mb))
        if indexed is not None:
            try:
                tar = open(url.removeprefix("file://"), "rb")  # noqa: SIM115 - closed below, after the generator
            except OSError:
                yield "shard_unreadable"
                return
            events: list[Event] = []
            with tar:
                window = TarWindow(tar.fileno())
                for sample in indexed:
                    events.append(self._indexed_record(sample, window))
                    yield events[-1]
            self._keep(url, events)
            return
        errors: list[str] = []
        for sample in read_samples(
            url,
            on_error=lambda reason, detail: errors.append(f"shard_{reason}"),
            max_member_bytes=file_limit(self.cfg.max_file_mb),
        ):
            yield from errors
            errors.clear()
            yield self._record(sample)
        yield from errors

    def _keep(self, url: str, events: list[Event]) -> None:
        """Keep a local tar's events (records hold only where their images lie) while the room lasts."""
        size = sum(sys.getsizeof(e) if isinstance(e, str) else sys.getsizeof(e[0]) + _RECORD_BYTES for e in events)
        if size <= self._records_room:
            self._records[url] = events
            self._records_room -= size

    def _record(self, sample: dict) -> Event:
        cfg = self.cfg
        member = image_member(sample, cfg.image_keys)
        if member is None:
            return "missing_image"
        image = sample[member]
        try:
            caption = _caption(sample, cfg.caption_key)
        except _Skip as skip:
            return skip.reason
        reason = probe_image(image, max_pixels=cfg.max_pixels, min_side=cfg.min_side)
        return reason or (caption, image)

    def _indexed_record(self, sample: dict[str, Any], tar: TarWindow) -> Event:
        """``_record`` of a sample from ``index_samples``: its caption read, its image probed from its head."""
        cfg = self.cfg
        member = image_member(sample, cfg.image_keys)
        if member is None:
            return "missing_image"
        text = METADATA_MEMBER if cfg.caption_key.startswith("json:") else cfg.caption_key
        ref: MemberRef = sample[member]
        try:
            caption = _caption({text: tar.read(sample[text])} if text in sample else {}, cfg.caption_key)
            head = tar.read(ref, _PROBE_HEAD)
            size = jpeg_size(head)
            if size is None:
                head = tar.read(ref) if len(head) < ref.size else head
        except _Skip as skip:
            return skip.reason
        except OSError:
            return "shard_unreadable"
        limits = {"max_pixels": cfg.max_pixels, "min_side": cfg.min_side}
        reason = probe_image(head, **limits) if size is None else _size_reason(size, **limits)
        return reason or (caption, ref)

    def epoch(self, seed: int, epoch: int) -> Iterator[Event]:
        urls = list(self.urls)
        if self.cfg.shuffle_shards:
            random.Random(_mix(seed, _TAG_SHARD_ORDER, epoch)).shuffle(urls)
        for url in urls:
            yield from self.read(url)

    def sequence(
        self, seed: int, start: int, epoch_length: int | None, on_epoch: Callable[[int], None]
    ) -> Iterator[Entry]:
        base, epoch = 0, 0
        while True:
            if epoch_length and base + epoch_length <= start:
                base, epoch = base + epoch_length, epoch + 1
                continue
            buffer = _ShuffleBuffer(self.cfg.shuffle_buffer, random.Random(_mix(seed, _TAG_BUFFER, epoch)))
            usable = emitted = 0
            for event in self.epoch(seed, epoch):
                if isinstance(event, str):
                    # Placed at the last usable record read before it, so a drop belongs to the epoch it is in.
                    where = base + max(usable - 1, 0)
                    if where >= start:
                        yield False, where, event
                    continue
                usable += 1
                out = buffer.push(event)
                if out is not None:
                    if base + emitted >= start:
                        yield True, base + emitted, out
                    emitted += 1
            for out in buffer.drain():
                if base + emitted >= start:
                    yield True, base + emitted, out
                emitted += 1
            if usable == 0:
                raise ValueError(f"no usable training samples in a whole epoch of {self.describe()}")
            epoch_length = usable
            on_epoch(usable)
            base, epoch = base + usable, epoch + 1

    def draws(self, run_seed: int, seed: int) -> Iterator[Draw]:
        rng = random.Random(seed)
        buffer = _ShuffleBuffer(self.cfg.shuffle_buffer, random.Random(_mix(seed, _TAG_BUFFER)))
        seen = usable = 0
        while True:
            for event in self.read(rng.choice(self.urls)):
                seen += 1
                if isinstance(event, str):
                    if usable == 0 and seen > 100_000:
                        raise ValueError(
                            f"no usable training samples among the first {seen} read from {self.describe()}"
                        )
                    yield event
                    continue
                record = buffer.push(event)
                if record is None:
                    continue
                usable += 1
                yield _mix(seed, _TAG_AUGMENT, usable), record

    def cache_key(self, payload: Record) -> MemberRef | None:
        """Where a member's bytes lie in a local tar; a sample read as bytes from a stream has no such place."""
        return payload[1] if isinstance(payload[1], MemberRef) else None

    def materialize(self, payload: Record) -> Record:
        caption, image = payload
        if isinstance(image, MemberRef):
            from openalign.data.transforms import BadImage

            try:
                return caption, image.read()
            except OSError as err:
                raise BadImage("unreadable", f"{image.path}: {err}") from err
        return payload


class _SyntheticSource:
    """Rows of ``openalign.data.synthetic.SyntheticWorld``, addressed by index: a reader renders only the
    samples it owns. Every caption is kept, noise included: it is the noise the model must learn through.

    An endless stream (``size: null``) takes row ``i`` at position ``i`` (rows are independent draws, so no
    shuffle is needed); a finite one repeats rows ``0 … size-1`` in a new seeded permutation every epoch.
    """

    def __init__(self, cfg: DataConfig, seed: int):
        from openalign.data.synthetic import SyntheticWorld

        self.cfg, self.size = cfg, cfg.synthetic.size
        self.world = SyntheticWorld(seed, cfg.synthetic.image_size, cfg.synthetic.languages)
        self._perm: tuple[int, np.ndarray] | None = None

    def fingerprint(self) -> str:
        s = self.cfg.synthetic
        # An English world keeps the fingerprint its checkpoints were written with.
        languages = [list(s.languages)] if tuple(s.languages) != ("en",) else []
        return json.dumps(["synthetic", self.world.seed, s.noise, s.image_size, s.size, *languages])

    def describe(self) -> str:
        return "the synthetic world"

    def row_index(self, seed: int, pos: int) -> int:
        if self.size is None:
            return pos
        epoch, j = divmod(pos, self.size)
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.default_rng(_mix(seed, _TAG_BUFFER, epoch))
            self._perm = (epoch, rng.permutation(self.size))
        return int(self._perm[1][j])

    def random_index(self, rng: random.Random) -> int:
        return rng.randrange(self.size if self.size is not None else 1 << 40)

    def sequence(
        self, seed: int, start: int, epoch_length: int | None, on_epoch: Callable[[int], None]
    ) -> Iterator[Entry]:
        # Addressable: a payload is the row index, and no row is ever dropped.
        for pos in itertools.count(start):
            yield True, pos, self.row_index(seed, pos)

    def draws(self, run_seed: int, seed: int) -> Iterator[Draw]:
        rng = random.Random(seed)
        batch = self.cfg.batch_size
        for n in itertools.count():
            for i in range(batch):
                yield _mix(run_seed, _TAG_AUGMENT, _mix(seed, n, i)), self.random_index(rng)

    def cache_key(self, payload: int) -> int:
        return payload  # the row's index: its caption and image follow from it

    def materialize(self, payload: int) -> Record:
        row = self.world.row(payload, self.cfg.synthetic.noise, n_rows=self.size)
        return row.caption, self.world.render(row.scene)


# --------------------------------------------------------------------------------------------------
# The per-worker piece builder


@dataclass
class _Plan:
    """Everything a reader needs, picklable so DataLoader workers can receive it."""

    source: TrainSource
    cfg: DataConfig
    tokenizer: TextTokenizer
    image: dict[str, Any]  # image_size, resize, mean, std (the transform is built where it runs: closures don't pickle)
    rank: int
    world_size: int
    seed: int
    start: int  # global samples consumed before this iteration
    epoch_length: int | None  # usable samples per epoch, when already known for this source

    @property
    def piece(self) -> int:
        return piece_rows(self.cfg)

    @property
    def pieces(self) -> int:
        return pieces_per_batch(self.cfg)


def piece_rows(cfg: DataConfig) -> int:
    """Samples per piece: ``data.piece_size``, at most the per-rank batch."""
    return min(cfg.piece_size, cfg.batch_size)


def pieces_per_batch(cfg: DataConfig) -> int:
    """Pieces per per-rank batch (the last may be shorter)."""
    return -(-cfg.batch_size // piece_rows(cfg))


# A piece of a rank's batch: (uint8 pixels [n,3,H,W], input_ids [n,L], attention_mask [n,L], meta); with
# ``decode: cuda`` its pixels are an ``_encode_rows`` dict instead, decoded by the training process.
Piece = tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict]
# A sample made ready for the device: the encoded JPEG (1-D uint8), its crop box and its flip.
Encoded = tuple[torch.Tensor, tuple[int, int, int, int], bool]


def _encode_rows(rows: list[Any], image_size: int) -> dict[str, torch.Tensor]:
    """A piece's rows, each an ``Encoded`` sample or uint8 pixels (decoded by the worker), as tensors:
    ``data`` the encoded bytes end to end, row ``i``'s from ``offsets[i]`` to ``offsets[i + 1]`` (none for a
    decoded row), ``boxes`` [n, 4], ``flips`` [n], and ``pixels`` [m, 3, S, S] of the decoded ``rows`` [m]."""
    encoded = [r if isinstance(r, tuple) else None for r in rows]
    decoded = [i for i, r in enumerate(encoded) if r is None]
    lengths = [0 if r is None else r[0].numel() for r in encoded]
    empty = torch.empty(0, dtype=torch.uint8)
    return {
        "data": torch.cat([r[0] for r in encoded if r is not None] or [empty]),
        "offsets": torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.long),
        "boxes": torch.tensor([(0, 0, 0, 0) if r is None else r[1] for r in encoded], dtype=torch.long),
        "flips": torch.tensor([r is not None and r[2] for r in encoded], dtype=torch.bool),
        "pixels": torch.stack([rows[i] for i in decoded])
        if decoded
        else torch.empty((0, 3, image_size, image_size), dtype=torch.uint8),
        "rows": torch.tensor(decoded, dtype=torch.long),
    }


class _Reader:
    """Builds this (rank, worker)'s pieces, in the order the training process assembles them."""

    def __init__(self, plan: _Plan, worker: int, workers: int, in_main_process: bool):
        from openalign.data.transforms import eval_transform, train_transform

        self.p, self.worker, self.workers, self.in_main = plan, worker, workers, in_main_process
        self.epoch_length = plan.epoch_length
        random_crop = self.random_crop = plan.cfg.crop == "random"
        image = {**plan.image, "normalize": False}  # uint8 until the device
        self.transform: Callable[[Image.Image | np.ndarray], torch.Tensor] = (
            train_transform(**image, flip=plan.cfg.flip) if random_crop else eval_transform(**image)
        )
        # Decoded images by sample (the source's ``cache_key``): resized and uncropped for random crops, the crop
        # itself for centre crops. Filled until ``cache_mb`` is reached, never evicted: a dataset that fits stays
        # whole.
        self.cache: dict[Any, tuple[str, torch.Tensor]] = {}
        self.cache_bytes = 0
        self.cache_limit = int(plan.cfg.cache_mb * 2**20 * (1 - _RECORDS_SHARE)) if plan.cfg.decode == "cpu" else 0
        # The rows tokenising a caption gave (ids, mask), in the same room: a caption of a cached sample comes back
        # every epoch, and tokenising it again would be a large share of a reader's work a batch.
        self.tokens: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ the global sequence

    def _global(self, start: int) -> Iterator[Entry]:
        """The source's global sequence from position ``start`` on; learns the epoch length as it goes."""

        def learned(length: int) -> None:
            self.epoch_length = length

        return self.p.source.sequence(self.p.seed, start, self.epoch_length, learned)

    def __iter__(self) -> Iterator[Piece]:
        return self._resampled() if self.p.cfg.resampled else self._exact()

    def _exact(self) -> Iterator[Piece]:
        p = self.p
        W, K, k = p.world_size, self.workers, self.worker
        size, per_batch, batch = p.piece, p.pieces, p.cfg.batch_size
        window = W * batch
        own: list[tuple[int, Any]] = []  # (position, payload) of this reader's samples of the piece
        pending: Counter[tuple[int, str]] = Counter()  # (piece, reason) of drops this reader counts
        # Refill candidates: piece q of a batch takes every (pieces)-th of the samples just before the batch, so
        # the pieces of one batch never refill a slot with the same sample.
        recent: deque[tuple[int, Any]] = deque(maxlen=_REFILL_POOL * per_batch)
        before: list[tuple[int, Any]] = []
        # Start a little early so that a resumed run has the same refill candidates as a straight one.
        for is_item, pos, payload in self._global(max(0, p.start - _REFILL_POOL * per_batch)):
            if pos < p.start:
                if is_item:
                    recent.append((pos, payload))
                continue
            step, offset = divmod(pos - p.start, window)
            mine = offset % W == p.rank
            j = offset // W  # the sample's index in this rank's batch, when it is this rank's
            q = j // size
            piece = step * per_batch + q
            ours = mine and piece % K == k
            if not is_item:
                if ours:
                    pending[piece, payload] += 1
                continue
            if offset == 0:
                before = list(reversed(recent))  # samples of earlier steps, newest first
            if ours:
                own.append((pos, payload))
            recent.append((pos, payload))
            if ours and j == min((q + 1) * size, batch) - 1:
                skipped: Counter[str] = Counter()
                for key in [key for key in pending if key[0] <= piece]:
                    skipped[key[1]] += pending.pop(key)
                yield self._piece(own, before[q::per_batch], skipped)
                own = []

    def _resampled(self) -> Iterator[Piece]:
        from openalign.data.transforms import BadImage

        p = self.p
        seed = _mix(p.seed, _TAG_RESAMPLE, p.rank, self.worker, p.start)
        pixels: list[torch.Tensor | Encoded] = []
        captions: list[str] = []
        skipped: Counter[str] = Counter()
        in_main = self.in_main
        # The piece sizes of a batch, in order, over and over: the training process takes pieces round-robin.
        every = itertools.cycle([min(p.piece, p.cfg.batch_size - q * p.piece) for q in range(p.pieces)])
        sizes = itertools.islice(every, self.worker, None, self.workers)
        want = next(sizes)
        for draw in p.source.draws(p.seed, seed):
            if isinstance(draw, str):
                skipped[draw] += 1
                continue
            sample_seed, payload = draw
            try:
                with torch.random.fork_rng(devices=[]) if in_main else contextlib.nullcontext():
                    caption, row = self._sample(payload, sample_seed)
                pixels.append(row)
                captions.append(caption)
            except BadImage as err:
                # Nothing to keep exact here: the next sample simply takes the place.
                skipped[err.reason] += 1
            if len(pixels) == want:
                yield self._assemble(pixels, captions, skipped)
                pixels, captions, skipped = [], [], Counter()
                want = next(sizes)

    # ------------------------------------------------------------------ decoding

    def _sample(self, payload: Any, sample_seed: int) -> tuple[str, torch.Tensor | Encoded]:
        """(caption, ``_row``) of one sample; a sample the cache holds is only cropped, with the same draws."""
        from openalign.data.transforms import random_crop_pixels, resized_pixels

        key = self.p.source.cache_key(payload) if self.cache_limit else None
        kept = None if key is None else self.cache.get(key)
        if kept is None:
            record = self.p.source.materialize(payload)
            if key is None:
                return record[0], self._row(record, sample_seed)
            image = self._decode(record)
            pixels = resized_pixels(image, self.p.image["resize"]) if self.random_crop else self.transform(image)
            kept = record[0], pixels
            if self.cache_bytes + pixels.nbytes <= self.cache_limit:
                self.cache[key] = kept
                self.cache_bytes += pixels.nbytes
        caption, pixels = kept
        if not self.random_crop:
            return caption, pixels
        torch.default_generator.manual_seed(sample_seed)
        return caption, random_crop_pixels(pixels, self.p.image["image_size"], self.p.cfg.flip)

    def _row(self, record: Record, sample_seed: int) -> torch.Tensor | Encoded:
        """A sample's uint8 crop, or with ``decode: cuda`` its encoded JPEG with the crop box and flip that the
        CPU transform would draw from the same seed (the header alone is read, and checked as the CPU path
        checks it); an image the GPU decoder would not take is decoded here as with ``decode: cpu``."""
        from openalign.data.device_decode import device_decodable
        from openalign.data.transforms import center_crop, open_image, random_crop

        image, cfg, opts = record[1], self.p.cfg, self.p.image
        if cfg.decode == "cuda" and isinstance(image, bytes | bytearray):
            data = bytes(image)
            header = open_image(data, max_pixels=cfg.max_pixels, min_side=cfg.min_side)
            if device_decodable(data, header):
                size, resize = opts["image_size"], opts["resize"]
                torch.default_generator.manual_seed(sample_seed)
                if self.random_crop:
                    box, flip = random_crop(size, resize, cfg.flip)
                else:
                    box, flip = center_crop(size, resize), False
                return torch.frombuffer(bytearray(data), dtype=torch.uint8), box, flip
        return self._pixels(record, sample_seed)

    def _pixels(self, record: Record, sample_seed: int) -> torch.Tensor:
        image = self._decode(record)
        torch.default_generator.manual_seed(sample_seed)  # torch.manual_seed would also seed (slowly) every accelerator
        return self.transform(image)

    def _decode(self, record: Record) -> Image.Image | np.ndarray:
        """The record's image as RGB pixels (an array, or a PIL image where the fast JPEG path does not apply)."""
        from openalign.data.transforms import decode_jpeg_pixels, pil_decode_image

        image: Image.Image | np.ndarray | bytes | bytearray = record[1]
        cfg = self.p.cfg
        if isinstance(image, bytes | bytearray):
            # A JPEG at least twice the resize in both sides is decoded scaled down in the DCT (PIL's draft mode):
            # a fraction of the work, and the resize that follows starts nearer its target.
            side = self.p.image["resize"] if cfg.draft else None
            draft = (side, side) if side else None
            data, limits = bytes(image), {"max_pixels": cfg.max_pixels, "min_side": cfg.min_side}
            # Most web images are plain JPEGs: libjpeg-turbo's pixels straight into an array, PIL's very pixels.
            # Where it does not apply, PIL decodes (and names what is wrong) without the fast path tried again.
            pixels = decode_jpeg_pixels(data, **limits, draft=draft)
            image = pixels if pixels is not None else pil_decode_image(data, **limits, draft=draft)
        elif isinstance(image, Image.Image) and image.mode != "RGB":
            image = image.convert("RGB")
        return image

    def _piece(self, own: list[tuple[int, Any]], pool: list[tuple[int, Any]], skipped: Counter[str]) -> Piece:
        from openalign.data.transforms import BadImage

        p = self.p
        skipped = Counter(skipped)
        pixels: list[torch.Tensor | Encoded | None] = []
        captions: list[str | None] = []
        # Seeding torch's generator per sample must not disturb the training process's own draws.
        guard = torch.random.fork_rng(devices=[]) if self.in_main else contextlib.nullcontext()
        with guard:
            for pos, payload in own:
                try:
                    caption, row = self._sample(payload, _mix(p.seed, _TAG_AUGMENT, pos))
                    pixels.append(row)
                    captions.append(caption)
                except BadImage as err:
                    skipped[err.reason] += 1
                    pixels.append(None)
                    captions.append(None)
            holes = [i for i, x in enumerate(pixels) if x is None]
            refills = iter(pool)
            for i in holes:
                for pos, payload in refills:
                    try:
                        captions[i], pixels[i] = self._sample(payload, _mix(p.seed, _TAG_REFILL, pos))
                        break
                    except BadImage:
                        continue  # its owner counted it already
        good = [i for i, x in enumerate(pixels) if x is not None]
        if not good:
            raise ValueError(f"no decodable image in a whole piece of {p.source.describe()} ({dict(skipped)})")
        for n, i in enumerate(i for i, x in enumerate(pixels) if x is None):
            # Only at the very start of a stream (no earlier sample to refill from): repeat one of this piece.
            pixels[i], captions[i] = pixels[good[n % len(good)]], captions[good[n % len(good)]]
        return self._assemble(pixels, captions, skipped)

    def _assemble(self, pixels: list[Any], captions: list[Any], skipped: Counter[str]) -> Piece:
        input_ids, attention_mask = self._tokens(captions)
        meta = {"skipped": dict(skipped), "epoch_length": self.epoch_length}
        if self.p.cfg.decode == "cuda":
            return _encode_rows(pixels, self.p.image["image_size"]), input_ids, attention_mask, meta
        return torch.stack(pixels), input_ids, attention_mask, meta

    def _tokens(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The captions' ``input_ids`` and ``attention_mask``. With the cache on, a caption already tokenised takes
        its kept rows: the tokenizer pads every caption to ``max_text_length``, so its row is the same in any
        batch."""
        length = self.p.cfg.max_text_length
        if not self.cache_limit:
            tokens = self.p.tokenizer(captions, max_length=length)
            return tokens["input_ids"], tokens["attention_mask"]
        new = [c for c in dict.fromkeys(captions) if c not in self.tokens]
        fresh: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if new:
            tokens = self.p.tokenizer(new, max_length=length)
            for caption, ids, mask in zip(new, tokens["input_ids"], tokens["attention_mask"], strict=True):
                fresh[caption] = ids, mask
                size = sys.getsizeof(caption) + ids.nbytes + mask.nbytes
                if self.cache_bytes + size <= self.cache_limit:
                    self.tokens[caption] = ids.clone(), mask.clone()  # not views holding the whole batch
                    self.cache_bytes += size
        rows = [self.tokens.get(c) or fresh[c] for c in captions]
        return torch.stack([ids for ids, _ in rows]), torch.stack([mask for _, mask in rows])


class _Dataset(torch.utils.data.IterableDataset):
    def __init__(self, plan: _Plan):
        super().__init__()
        self.plan = plan

    def __iter__(self) -> Iterator[Piece]:
        info = torch.utils.data.get_worker_info()
        if info is None:
            return iter(_Reader(self.plan, 0, 1, in_main_process=True))
        return iter(_Reader(self.plan, info.id, info.num_workers, in_main_process=False))


# --------------------------------------------------------------------------------------------------
# The stream the training loop iterates


def batch_bytes(cfg: DataConfig, image_size: int, rows: int | None = None) -> int:
    """Host bytes of ``rows`` pairs (default: a per-rank batch) as they travel: uint8 pixels, int64 tokens."""
    rows = cfg.batch_size if rows is None else rows
    return rows * (3 * image_size * image_size + 2 * 8 * cfg.max_text_length)


def _two_digits_up(x: float) -> float:
    """``x`` rounded up to two significant digits, so that a small need reads as itself and suffices."""
    scale = 10.0 ** (math.floor(math.log10(x)) - 1)
    return math.ceil(round(x / scale, 9)) * scale


def prefetch_pieces(cfg: DataConfig, image_size: int) -> int:
    """Pieces each worker may have decoded ahead: as many as ``data.prefetch_gb`` holds for all workers, and no
    more than two batches' worth, for each worker at least one. Raises ConfigError when the budget cannot hold a
    whole batch (the workers could then never run a batch ahead of the step) or one piece per worker."""
    budget = cfg.prefetch_gb * GB
    batch = batch_bytes(cfg, image_size)
    piece = batch_bytes(cfg, image_size, piece_rows(cfg))
    workers = max(cfg.workers, 1)
    if budget < batch or budget < workers * piece:
        need = _two_digits_up(max(batch, workers * piece) / GB)
        raise ConfigError(
            f"data.prefetch_gb {cfg.prefetch_gb:g} cannot hold one batch of {cfg.batch_size} pairs at {image_size} px "
            f"with {cfg.workers} workers ({need:g} GB as uint8); raise data.prefetch_gb to at least {need:g} "
            "or lower the batch"
        )
    in_flight = min(int(budget // piece), 2 * pieces_per_batch(cfg))
    return max(1, in_flight // workers)


# A batch the training loop may pin in page-locked memory at most: above it the copy is a small part of the step.
PIN_LIMIT = 256 * 2**20


def pin_batches(cfg: DataConfig, device: torch.device | str, model_config: ModelConfig | None = None) -> bool:
    """``data.pin_memory`` for a run on ``device``: as set, or when unset, whether the device is a GPU and a
    per-rank batch's pixels fit in ``PIN_LIMIT``."""
    if cfg.pin_memory is not None:
        return cfg.pin_memory
    size = image_options(cfg, model_config)["image_size"]
    return torch.device(device).type == "cuda" and cfg.batch_size * 3 * size * size <= PIN_LIMIT


T = TypeVar("T")


def _one_ahead(make: Callable[[], T]) -> Iterator[T]:
    """``make()``, again and again, each call made in a thread while the caller uses the result before it; an
    error ``make`` raises is raised to the caller when it asks for that result. The thread makes one result ahead,
    never more, and ends once the caller has let go of the iterator."""
    asked: queue.SimpleQueue[bool] = queue.SimpleQueue()
    made: queue.SimpleQueue[tuple[T] | BaseException] = queue.SimpleQueue()  # a result, or what making it raised

    def run() -> None:
        while asked.get():
            try:
                made.put((make(),))
            except BaseException as err:  # handed to the caller, which raises it
                made.put(err)
                return

    def take() -> T:
        got = made.get()
        if isinstance(got, BaseException):
            raise got
        asked.put(True)
        return got[0]

    asked.put(True)
    threading.Thread(target=run, name="openalign-batch-assembly", daemon=True).start()
    try:
        while True:
            # Yielded straight from the call: the caller's reference is the only one, so what it lets go of is freed
            # then, during its step, not when it asks for the next.
            yield take()
    finally:
        asked.put(False)


class TrainStream:
    """Endless batches ``{pixel_values [B,3,H,W] uint8, input_ids [B,L] long, attention_mask [B,L] long}``;
    ``pixels`` turns pixel values into the model's input (float, normalised) on whatever device they are.

    ``state_dict()`` holds the position (samples consumed globally), the skip counts of this rank and the
    epoch length once known; ``load_state_dict`` before iterating resumes there, on any world size. Each
    ``iter()`` starts DataLoader workers at the current position.

    With ``decode: cuda`` the batches' pixel values are made on ``decoder``'s device, piece by piece as the pieces
    come (``DeviceDecoder`` on the current CUDA device unless one is set before iterating). A JPEG that its header
    passed but no decoder reads is counted as ``corrupt`` and its row repeats another of its piece.
    """

    def __init__(self, plan: _Plan):
        self._plan = plan
        self.decoder: DeviceDecoder | None = None
        self.position = plan.start
        self.stats: Counter[str] = Counter()
        self._epoch_length: int | None = None
        self._fingerprint = hashlib.sha256(plan.source.fingerprint().encode()).hexdigest()[:16]
        self.prefetch = prefetch_pieces(plan.cfg, plan.image["image_size"])

    @property
    def batch_size(self) -> int:
        return self._plan.cfg.batch_size

    @property
    def global_batch_size(self) -> int:
        return self._plan.cfg.batch_size * self._plan.world_size

    @property
    def pixels(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """uint8 pixel values → the model's input, with this stream's pixel mean and std."""
        from openalign.data.transforms import normalize_pixels

        return functools.partial(normalize_pixels, mean=self._plan.image["mean"], std=self._plan.image["std"])

    def recorded_length(self, enough: int) -> int | None:
        """The samples the source's own records say it holds (counted up to ``enough``), known before any is
        read; None when it keeps no such record."""
        recorded = getattr(self._plan.source, "recorded_samples", None)
        return recorded(enough) if recorded is not None else None

    @property
    def epoch_length(self) -> int | None:
        """Usable samples per epoch: a finite synthetic world's size, or for shards known once some worker has
        read a whole epoch (None before, and always for an endless or resampled source)."""
        if self._epoch_length is None and isinstance(self._plan.source, _SyntheticSource):
            return self._plan.source.size
        return self._epoch_length

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        cfg = self._plan.cfg
        plan = dataclasses.replace(self._plan, start=self.position, epoch_length=self._epoch_length)
        dataset = _Dataset(plan)
        if cfg.workers == 0:
            pieces: Any = iter(dataset)
        else:
            # Workers tokenise; the Rust tokenizer's own thread pool would only fight them for cores.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            pieces = torch.utils.data.DataLoader(
                dataset, batch_size=None, num_workers=cfg.workers, prefetch_factor=self.prefetch
            )
        decoder = self._decoder() if cfg.decode == "cuda" else None
        pin = bool(cfg.pin_memory) and torch.cuda.is_available()
        assemble = functools.partial(self._assemble, iter(pieces), decoder, plan.image["image_size"], pin)
        # With pin_memory, the next batch is assembled while the step runs (the pieces come from workers: the thread
        # mostly waits for them and copies, neither holding the GIL). GPU decoding stays on the loop's thread,
        # whose CUDA device and stream it uses.
        ahead = bool(cfg.pin_memory) and cfg.workers > 0 and decoder is None
        batches = _one_ahead(assemble) if ahead else iter(assemble, None)
        while True:
            yield self._taken(*next(batches))

    def _taken(
        self, batch: dict[str, torch.Tensor], skipped: Counter[str], epoch_length: int | None
    ) -> dict[str, torch.Tensor]:
        """``batch``, counted as the loop takes it: a checkpoint's position and counts are then the steps'."""
        self.stats.update(skipped)
        if epoch_length:
            self._epoch_length = epoch_length
        self.position += self.global_batch_size
        return batch

    def _assemble(
        self, pieces: Iterator[Piece], decoder: DeviceDecoder | None, size: int, pin: bool
    ) -> tuple[dict[str, torch.Tensor], Counter[str], int | None]:
        """The next batch from its pieces, with the samples its pieces skipped and the epoch length once a piece
        has learned it."""
        cfg = self._plan.cfg
        # Filled piece by piece: the batch exists once, in the memory the host-to-device copy reads.
        if decoder is None:
            pixels = torch.empty((cfg.batch_size, 3, size, size), dtype=torch.uint8, pin_memory=pin)
        else:
            pixels = torch.empty((cfg.batch_size, 3, size, size), dtype=torch.uint8, device=decoder.device)
        tokens = torch.empty((2, cfg.batch_size, cfg.max_text_length), dtype=torch.long, pin_memory=pin)
        skipped: Counter[str] = Counter()
        epoch_length = None
        row = 0
        while row < cfg.batch_size:
            piece_pixels, input_ids, attention_mask, meta = next(pieces)
            n = input_ids.shape[0]
            if isinstance(piece_pixels, dict):
                self._decode(decoder, piece_pixels, pixels[row : row + n])
            else:
                pixels[row : row + n] = piece_pixels
            tokens[0, row : row + n] = input_ids
            tokens[1, row : row + n] = attention_mask
            row += n
            skipped.update(meta["skipped"])
            epoch_length = int(meta["epoch_length"]) if meta["epoch_length"] else epoch_length
            del piece_pixels, input_ids, attention_mask
        return {"pixel_values": pixels, "input_ids": tokens[0], "attention_mask": tokens[1]}, skipped, epoch_length

    def _decoder(self) -> DeviceDecoder:
        if self.decoder is None:
            from openalign.data.device_decode import DeviceDecoder

            if not torch.cuda.is_available():
                raise ConfigError("data.decode: cuda needs a CUDA device (use data.decode: cpu)")
            image = self._plan.image
            device = torch.device("cuda", torch.cuda.current_device())
            self.decoder = DeviceDecoder(image["image_size"], image["resize"], device)
        return self.decoder

    def _decode(self, decoder: DeviceDecoder | None, piece: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        """A ``decode: cuda`` piece's pixels into ``out`` (its rows of the batch, on the decoder's device)."""
        if decoder is None:
            raise ValueError("a piece of encoded images reached a stream that decodes on the CPU")
        decoded = piece["rows"].tolist()
        if decoded:  # the rows a worker decoded (not JPEG, or not one the GPU decoder takes)
            out[piece["rows"].to(out.device)] = piece["pixels"].to(out.device, non_blocking=True)
        skip = set(decoded)
        encoded = [i for i in range(out.shape[0]) if i not in skip]
        offsets, data = piece["offsets"].tolist(), piece["data"]
        boxes, flips = piece["boxes"].tolist(), piece["flips"].tolist()
        _, failed = decoder(
            [data[offsets[i] : offsets[i + 1]] for i in encoded],
            [boxes[i] for i in encoded],
            [flips[i] for i in encoded],
            out=out,
            rows=encoded,
        )
        if not failed:
            return
        bad = {encoded[i] for i in failed}
        good = [i for i in range(out.shape[0]) if i not in bad]
        if not good:
            raise ValueError(f"no decodable image in a whole piece of {self._plan.source.describe()}")
        for n, i in enumerate(sorted(bad)):
            out[i] = out[good[n % len(good)]]
        self.stats["corrupt"] += len(bad)

    def state_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "stats": dict(self.stats),
            "epoch_length": self._epoch_length,
            "source": self._fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        position = state.get("position")
        if not isinstance(position, int) or position < 0:
            raise ValueError(f"data stream state has no valid 'position' (got {position!r})")
        self.position = position
        self.stats = Counter(state.get("stats") or {})
        # An epoch length measured on other data (or other skip rules) would misplace every later epoch.
        same = state.get("source") == self._fingerprint
        self._epoch_length = state.get("epoch_length") if same else None


def image_options(cfg: DataConfig, model_config: ModelConfig | None = None) -> dict[str, Any]:
    """Crop size, resize, pixel mean/std: the data config's, else the model's, else the paper's."""
    from openalign.data.transforms import model_resize

    size = cfg.image_size or (model_config.image_size if model_config else 289)
    return {
        "image_size": size,
        "resize": cfg.resize or model_resize(size),
        "mean": tuple(cfg.pixel_mean or (model_config.pixel_mean if model_config else (0.5, 0.5, 0.5))),
        "std": tuple(cfg.pixel_std or (model_config.pixel_std if model_config else (0.5, 0.5, 0.5))),
    }


def build_train_stream(
    cfg: DataConfig,
    tokenizer: TextTokenizer | None = None,
    *,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    model_config: ModelConfig | None = None,
) -> TrainStream:
    """The training stream of rank ``rank`` of ``world_size`` (see the module docstring for the order).

    ``tokenizer`` defaults to loading ``cfg.tokenizer``; ``cfg.seed`` (when set) overrides ``seed``.
    """
    cfg.validate()
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    if tokenizer is None:
        if not cfg.tokenizer:
            raise ConfigError("data.tokenizer must name a tokenizer file or directory (from `openalign vocab`)")
        from openalign.text import load_tokenizer

        tokenizer = load_tokenizer(cfg.tokenizer, max_length=cfg.max_text_length)
    if model_config is not None and cfg.max_text_length > model_config.text.max_position_embeddings:
        raise ConfigError(
            f"data.max_text_length {cfg.max_text_length} exceeds the model's "
            f"{model_config.text.max_position_embeddings} text positions"
        )
    opts = image_options(cfg, model_config)
    if opts["resize"] < opts["image_size"]:
        raise ConfigError(f"data.resize {opts['resize']} is smaller than the crop size {opts['image_size']}")
    if cfg.source == "shards":
        urls = expand_urls(cfg.shards if isinstance(cfg.shards, str) else list(cfg.shards))
        if not urls:
            raise ValueError(f"data.shards {cfg.shards!r} names no shard")
        # A missing shard among others is skipped and counted (shard_missing); with none there, every worker
        # would only fail with nothing to train on.
        if not any(is_remote(u) or os.path.exists(u) for u in urls):
            raise FileNotFoundError(f"data.shards: none of the {len(urls)} shard(s) exists (first: {urls[0]})")
        source: TrainSource = _ShardSource(urls, cfg)
    else:
        source = _SyntheticSource(cfg, cfg.seed if cfg.seed is not None else seed)
    run_seed = cfg.seed if cfg.seed is not None else seed
    plan = _Plan(source, cfg, tokenizer, opts, rank, world_size, run_seed, 0, None)
    return TrainStream(plan)


def reduce_stats(stats: Counter[str] | dict[str, int]) -> Counter[str]:
    """The skip counts of all ranks summed (a collective under torch.distributed; identity otherwise)."""
    import torch.distributed as dist

    local = Counter(stats)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(local))
    total: Counter[str] = Counter()
    for part in gathered:
        total.update(part)
    return total
