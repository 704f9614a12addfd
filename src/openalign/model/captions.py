"""Captions as the text tower reads them: the padding mask, the batch's width, cutting padding, length buckets.

Pure functions of token ids and masks. The model's ``encode_text`` uses them on the inputs it is given; training
applies them on the host before a batch reaches the device (``openalign.train.towers``).
"""

from __future__ import annotations

import torch

from openalign.model.layers import has_values, host_readable

__all__ = ["length_buckets", "padding_mask", "tokens_width", "trim_padding"]


def padding_mask(input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """1 for real tokens, 0 for ``pad_id``; the first ([CLS]) position always counts."""
    mask = (input_ids != pad_id).long()
    mask[:, 0] = 1
    return mask


def tokens_width(attention_mask: torch.Tensor) -> torch.Tensor:
    """The number of leading columns that hold every attended token (at least 1), as a 0-dim tensor on the
    mask's device: the columns after it are padding in every row. Computed without reading values, so callers
    can read it together with other figures."""
    columns = torch.arange(1, attention_mask.shape[1] + 1, device=attention_mask.device)
    return (attention_mask.ne(0) * columns).amax().clamp_min(1)


def trim_padding(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop trailing columns that are padding in every row (``width``, or the mask's ``tokens_width``).

    Masked keys contribute nothing, so the cut changes no output and saves the text tower the padding's work.
    Left padding keeps its full width, and so does a mask without values (fake or meta, as when planning memory).
    """
    if width is None:
        if not has_values(attention_mask):
            return input_ids, attention_mask
        width = int(tokens_width(attention_mask))
    if width >= attention_mask.shape[1]:
        return input_ids, attention_mask
    return input_ids[:, :width], attention_mask[:, :width]


def length_buckets(attention_mask: torch.Tensor, min_saving: float = 0.2) -> list[torch.Tensor] | None:
    """Row indices of a batch split in two by caption length (shorter rows, longer rows), or None.

    A batch of captions is padded to its longest: where a few long captions (noisy alt-text runs long) pad a
    batch of short ones, encoding the short rows apart skips that padding. The split is the one that pads
    least; it is used only when it saves at least ``min_saving`` of the batch's token positions, and only for
    right padding (what ``trim_padding`` cuts). Each row's embedding is unchanged up to float rounding, as rows
    never see each other. Only for a mask the host reads for free (``host_readable``): on a GPU the choice would
    take several host syncs.
    """
    rows, width = attention_mask.shape
    if rows < 2 or not host_readable(attention_mask):
        return None
    lengths = attention_mask.sum(1)
    if not bool((attention_mask == (torch.arange(width, device=lengths.device) < lengths[:, None])).all()):
        return None
    ordered, order = lengths.sort(stable=True)
    longest = int(ordered[-1])
    split = torch.arange(1, rows, device=lengths.device)
    padded = split * ordered[:-1] + (rows - split) * longest  # positions encoded with a split before each row
    best = int(padded.argmin())
    if int(padded[best]) > (1.0 - min_saving) * rows * longest:
        return None
    return [order[: best + 1], order[best + 1 :]]


def bucket_widths(
    attention_mask: torch.Tensor, groups: list[torch.Tensor] | None
) -> list[tuple[torch.Tensor, int]] | None:
    """``length_buckets``' groups with each one's width, as the text tower takes them; None for no groups."""
    if groups is None:
        return None
    return [(g, int(tokens_width(attention_mask[g]))) for g in groups]
