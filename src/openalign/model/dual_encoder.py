"""The ALIGN dual encoder: two towers, linear projections into one space, and a learned temperature."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from openalign.config import ImageTowerConfig, ModelConfig
from openalign.model.bert import Bert
from openalign.model.convnet import ConvNet
from openalign.model.efficientnet import EfficientNet
from openalign.model.layers import has_values, host_readable

if TYPE_CHECKING:
    from openalign.text.tokenizer import TextTokenizer


class DualEncoder(nn.Module):
    """Image and text encoders whose L2-normalised outputs are compared by cosine similarity.

    Logits are ``image_emb @ text_emb.T / temperature``. The image feature is projected only when its
    width differs from ``embed_dim`` (the paper projects B1/B3/B5 to 640; B7 and L2 are used as is);
    the text [CLS] feature always goes through a linear layer, as in the paper.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # Encode short captions apart from long ones (``length_buckets``). Off under FSDP, where every rank must
        # run its towers the same number of times (each run gathers the tower's shards).
        self.text_buckets = True
        # Captions arrive cut to their width and checked by the caller (training's loop, on the host, where that
        # costs no wait) and are taken as they come: no read, trim or buckets here. Set by ``compile_towers`` (a
        # compiled graph reads no values) and by training on an accelerator (each read there waits for all work).
        self.caller_cuts_captions = False
        # ``compile_towers``' functions, by grad mode: (image, text).
        self.compiled_towers: dict[bool, tuple[Callable[..., torch.Tensor], ...]] | None = None
        # Training with precision bf16-image sets this: the image tower runs under autocast to this dtype while
        # the model trains (its backward follows); the projection, the text tower, evaluation and serving keep
        # the weights' precision.
        self.image_autocast: torch.dtype | None = None
        self.image = image_tower(config.image)
        self.text = Bert(config.text)
        d = config.embed_dim
        self.image_proj = nn.Linear(self.image.num_features, d) if self.image.num_features != d else None
        self.text_proj = nn.Linear(self.text.num_features, d)
        for proj in (self.image_proj, self.text_proj):
            if proj is not None:
                # TF dense init, as the paper's code base uses: U(±1/sqrt(fan_out)).
                bound = 1.0 / math.sqrt(d)
                nn.init.uniform_(proj.weight, -bound, bound)
                nn.init.zeros_(proj.bias)
        init = config.temperature_init
        value = torch.tensor(math.log(init) if config.temperature_param == "log" else init)
        self.temperature_param = nn.Parameter(value, requires_grad=config.learn_temperature)
        if config.image.channels_last:
            self.image.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stub omits it
        if config.image.batch_norm == "sync":
            self.image = nn.SyncBatchNorm.convert_sync_batchnorm(self.image)
        self.locked: set[str] = set()  # towers ("image", "text") frozen by lock_image / lock_text

    # ------------------------------------------------------------------ locked towers (LiT)

    def tower_modules(self, tower: str) -> list[nn.Module]:
        """A tower and its projection: what locking it freezes and what ``init_image``/``init_text`` load."""
        if tower == "image":
            return [self.image] + ([self.image_proj] if self.image_proj is not None else [])
        if tower == "text":
            return [self.text, self.text_proj]
        raise ValueError(f"tower must be 'image' or 'text', got {tower!r}")

    @staticmethod
    def tower_prefixes(tower: str) -> tuple[str, ...]:
        """State-dict name prefixes of a tower and its projection."""
        return {"image": ("image.", "image_proj."), "text": ("text.", "text_proj.")}[tower]

    def lock_tower(self, tower: str) -> None:
        """Freeze a tower as LiT does: no gradients for its weights (so no optimizer state either) and eval mode
        for good, so its batch norm keeps its running statistics and dropout is off, whatever ``train()`` says."""
        for module in self.tower_modules(tower):
            module.requires_grad_(False)
            module.eval()
        self.locked.add(tower)

    def lock_image(self) -> None:
        self.lock_tower("image")

    def lock_text(self) -> None:
        self.lock_tower("text")

    def train(self, mode: bool = True) -> DualEncoder:
        super().train(mode)
        for tower in self.locked:
            for module in self.tower_modules(tower):
                module.eval()
        return self

    @property
    def embed_dim(self) -> int:
        return self.config.embed_dim

    @property
    def temperature(self) -> torch.Tensor:
        """σ > 0 (0-dim). Learned directly it is kept above 1e-4 so a bad step cannot flip its sign."""
        if self.config.temperature_param == "log":
            return self.temperature_param.exp()
        return self.temperature_param.clamp(min=1e-4)

    def no_weight_decay(self) -> set[str]:
        return {"temperature_param"}

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.image.gradient_checkpointing = enable
        self.text.gradient_checkpointing = enable

    def compile_towers(self, **options: Any) -> None:
        """``torch.compile`` both towers, each as one graph (``fullgraph=True``: a graph break is an error) per
        grad mode, so that gradient caching's no-graph pass and its graph pass each compile once and nothing
        compiles again. Captions then keep the width they arrive with: the caller measures them while they are still
        on the host, where that costs no wait, and cuts them to their longest (training cuts each chunk to its own,
        ``caption_widths``); the text tower's graph takes any width from two columns up (its sequence dimension is
        compiled as a symbol), so a new width compiles it again only where the backend's code branches on the width
        (``_any_width``). Nor are an accelerator's token ids checked in
        ``forward`` (``check_tokens``): that read would make the host wait for all queued work at every call; the
        caller checks the batch on the host, as training does. ``options`` go to ``torch.compile`` (``backend``,
        ``mode``)."""

        def compiled(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            return torch.compile(fn, fullgraph=True, **options)

        self.compiled_towers = {
            True: (compiled(_image_with_graph), compiled(_text_with_graph)),
            False: (compiled(_image_without_graph), compiled(_text_without_graph)),
        }
        self.caller_cuts_captions = True

    def _tower(self, which: int) -> Callable[..., torch.Tensor]:
        """The image (0) or text (1) tower as called now: its compiled function for this grad mode, if any."""
        tower: nn.Module = (self.image, self.text)[which]
        if self.compiled_towers is None:
            return tower
        compiled = self.compiled_towers[torch.is_grad_enabled()][which]
        if which == 1:
            return functools.partial(_any_width, compiled, tower)
        return functools.partial(compiled, tower)

    @contextmanager
    def eager_towers(self) -> Iterator[None]:
        """Inside, compiled towers run uncompiled and captions are trimmed again: for occasional calls whose
        shapes or modes differ from training's (in-training evaluation), which would otherwise compile graphs of
        their own."""
        cut = self.caller_cuts_captions
        self.caller_cuts_captions = False
        try:
            with torch.compiler.set_stance("force_eager"):
                yield
        finally:
            self.caller_cuts_captions = cut

    # ------------------------------------------------------------------ saving and loading

    def save_pretrained(self, path: str | Path, tokenizer: TextTokenizer | None = None) -> Path:
        """Write this model (and ``tokenizer``, if given) as an openalign checkpoint directory."""
        from openalign.model.io import save_model

        out = save_model(self, path)
        if tokenizer is not None:
            tokenizer.save(out)
        return out

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, map_location: str | torch.device = "cpu") -> DualEncoder:
        """An openalign or transformers AlignModel directory, or a hub id (``org/name``, ``hf-hub:org/name``)
        from the local Hugging Face cache; in eval mode."""
        from openalign.model.hub import resolve
        from openalign.model.io import load_model

        return load_model(resolve(name_or_path), map_location=map_location)

    # ------------------------------------------------------------------ encoding

    def check_pixels(self, pixel_values: torch.Tensor) -> None:
        if not isinstance(pixel_values, torch.Tensor):
            raise TypeError(f"pixel_values must be a torch.Tensor, got {type(pixel_values).__name__}")
        if pixel_values.ndim != 4 or pixel_values.shape[1] != 3:
            raise ValueError(f"pixel_values must have shape [B, 3, H, W], got {list(pixel_values.shape)}")
        if not pixel_values.is_floating_point():
            raise ValueError(
                f"pixel_values must be floating point (normalised pixels), got {pixel_values.dtype}; "
                "convert uint8 images with openalign's transforms first"
            )
        if pixel_values.shape[0] == 0:
            raise ValueError("pixel_values is an empty batch")

    def check_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> int | None:
        """Raise on token ids or a mask the model cannot take; return the mask's ``tokens_width`` (None without a
        mask, for tensors without values, and, where the caller cuts the captions, for an accelerator's tokens,
        whose values are then not read: see ``caller_cuts_captions``)."""
        cfg = self.config.text
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.ndim != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must have shape [B, L] with B, L > 0, got {list(input_ids.shape)}")
        if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        if input_ids.shape[1] > cfg.max_position_embeddings:
            raise ValueError(
                f"input_ids has {input_ids.shape[1]} tokens per row; the model has "
                f"{cfg.max_position_embeddings} positions"
            )
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {list(attention_mask.shape)} != input_ids shape {list(input_ids.shape)}"
            )
        if not has_values(input_ids) or (self.caller_cuts_captions and not host_readable(input_ids)):
            return None
        return self.check_token_values(input_ids, attention_mask)

    def check_token_values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> int | None:
        """``check_tokens``' checks of values, in one read: ids within the vocabulary, [CLS] kept; the mask's
        ``tokens_width`` returned (None without a mask)."""
        cfg = self.config.text
        # One host read for every check and the width: on a GPU each read is a sync (the host waits for all
        # queued kernels), so the four figures travel together.
        ones = torch.ones((), dtype=torch.long, device=input_ids.device)
        lo, hi, first_kept, width = torch.stack(
            [
                input_ids.min().long(),
                input_ids.max().long(),
                attention_mask[:, 0].all().long() if attention_mask is not None else ones,
                tokens_width(attention_mask) if attention_mask is not None else ones,
            ]
        ).tolist()
        if lo < 0 or hi >= cfg.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"token id {bad} is outside the model's vocabulary [0, {cfg.vocab_size}); "
                "was the text tokenised with this model's tokenizer?"
            )
        if not first_kept:
            raise ValueError("attention_mask must keep the first ([CLS]) token of every row")
        return int(width) if attention_mask is not None else None

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Unnormalised image embeddings [B, embed_dim]."""
        if self.image_autocast is not None and self.training:
            with torch.autocast(pixel_values.device.type, dtype=self.image_autocast):
                x = self._tower(0)(pixel_values)
            x = x.float()
        else:
            x = self._tower(0)(pixel_values)
        return self.image_proj(x) if self.image_proj is not None else x

    def text_features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, width: int | None = None
    ) -> torch.Tensor:
        """Unnormalised text embeddings [B, embed_dim]. ``width``: the mask's ``tokens_width`` when the caller has
        already read it (``check_tokens`` returns it), so that it is not read twice."""
        if attention_mask is None or self.caller_cuts_captions:
            return self._text_features(input_ids, attention_mask)
        # Short rows are encoded apart (two passes) only on the CPU, where arithmetic is the cost and the lengths
        # are free to read (``length_buckets``); on a GPU the batch is only cut to its width.
        groups = length_buckets(attention_mask) if self.text_buckets else None
        input_ids, attention_mask = trim_padding(input_ids, attention_mask, width if groups is None else None)
        # A CPU mask (the only kind with groups) gives each group's width for free.
        buckets = None if groups is None else [(g, int(tokens_width(attention_mask[g]))) for g in groups]
        out: torch.Tensor = self.text_proj(self.text(input_ids, attention_mask, buckets))
        return out

    def _text_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        out: torch.Tensor = self.text_proj(self._tower(1)(input_ids, attention_mask))
        return out

    def encode_image(self, pixel_values: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """L2-normalised image embeddings [B, embed_dim] from normalised pixels [B, 3, H, W]."""
        self.check_pixels(pixel_values)
        x = self.image_features(pixel_values)
        return F.normalize(x, dim=-1) if normalize else x

    def encode_text(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, normalize: bool = True
    ) -> torch.Tensor:
        """L2-normalised text embeddings [B, embed_dim] from token ids and a 1/0 attention mask.

        Without a mask, every ``text.pad_token_id`` after the first position is padding (what
        ``openalign.get_tokenizer``'s plain id tensors rely on); captions without padding attend to every token.
        """
        width = self.check_tokens(input_ids, attention_mask)
        if attention_mask is None:
            attention_mask = padding_mask(input_ids, self.config.text.pad_token_id)
        x = self.text_features(input_ids, attention_mask, width)
        return F.normalize(x, dim=-1) if normalize else x

    def forward(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both normalised embeddings, the inputs of ``openalign.loss.contrastive_loss``."""
        # The tokens are checked (the text tower's one host read) before the image tower is queued: on a GPU the
        # read then waits only for work queued before this step, not for the whole image forward.
        self.check_pixels(pixel_values)
        width = self.check_tokens(input_ids, attention_mask)
        if attention_mask is None:
            attention_mask = padding_mask(input_ids, self.config.text.pad_token_id)
        image = F.normalize(self.image_features(pixel_values), dim=-1)
        return image, F.normalize(self.text_features(input_ids, attention_mask, width), dim=-1)


def image_tower(cfg: ImageTowerConfig) -> ConvNet | EfficientNet:
    """The image tower ``cfg.family`` names: the plain convolutional stack or the EfficientNet."""
    return ConvNet(cfg) if cfg.family == "convnet" else EfficientNet(cfg)


# The compiled towers' entry points, one per tower and grad mode. Dynamo keeps its graphs per code object, guarded
# on grad mode among other things: one function called with and without a graph would compile twice, the second
# time as a recompilation. The tower is an argument, so that a copy of the model calls its own weights.
def _image_with_graph(tower: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    return tower(pixel_values)  # type: ignore[no-any-return]


def _image_without_graph(tower: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
    return tower(pixel_values)  # type: ignore[no-any-return]


def _text_with_graph(tower: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return tower(input_ids, mask)  # type: ignore[no-any-return]


def _text_without_graph(tower: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return tower(input_ids, mask)  # type: ignore[no-any-return]


def _any_width(
    compiled: Callable[..., torch.Tensor], tower: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """The compiled text tower on captions of any width: the width is marked a symbol before the first call
    compiles, so that one graph serves the widths (not one compilation per width). Widths 0 and 1 are left fixed
    (Dynamo specialises them anyway): a batch of captions one token wide compiles apart.

    The mark promises nothing (``maybe_mark_dynamic``: no range, and a backend may still fix the width): a backend
    may narrow the graph's widths while it compiles, and a promise made beforehand would make that narrowing an
    error. Inductor does narrow them on a CPU, whose code sums a float reduction of over 4,096 elements (batch ×
    width) in chunks and so guards on the width's side of that line (its CUDA lowering checks that attention's mask
    rows are 8-aligned, which ``additive_mask``'s are for every width). A width on the other side of such a line
    compiles once more.

    The captions come contiguous and at the start of their storage: a batch cut to a width below its padded one is
    a view whose rows lie a padded row apart, one at its full width is not, and Dynamo guards on which (the view's
    row stride is a separate symbol), so a full-width batch after a cut one (long alt-text truncated at
    ``max_length`` does it) compiled a second graph. Dynamo guards on a tensor's storage offset too (0, or 2 and
    more): the stream's mask lies after the token ids in one storage, and a gradient-cached step's later chunks
    rows into theirs, while a cut copy starts its own. On a CPU, where the batch is not copied to a device, a first
    uncut batch compiled the graph for masks 2 or more in, and the first cut one compiled it again. Copying is a
    small kernel per tensor; captions already contiguous at the start of their storage (a GPU's copy of a whole
    batch) are passed as they are."""
    input_ids = _own_storage(input_ids)
    mask = _own_storage(mask) if mask is not None else None
    for t in (input_ids, mask):
        if t is not None and t.shape[1] >= 2:
            torch._dynamo.maybe_mark_dynamic(t, 1)
    return compiled(tower, input_ids, mask)


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous at the start of its storage: itself if it is, else a copy."""
    return t if t.is_contiguous() and t.storage_offset() == 0 else t.clone(memory_format=torch.contiguous_format)


def padding_mask(input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """1 for real tokens, 0 for ``pad_id``; the first ([CLS]) position always counts."""
    mask = (input_ids != pad_id).long()
    mask[:, 0] = 1
    return mask


def length_buckets(attention_mask: torch.Tensor, min_saving: float = 0.2) -> list[torch.Tensor] | None:
    """Row indices of a batch split in two by caption length (shorter rows, longer rows), or None.

    A batch of captions is padded to its longest: where a few long captions (noisy alt-text runs long) pad a
    batch of short ones, encoding the short rows apart skips that padding. The split is the one that pads
    least; it is used only when it saves at least ``min_saving`` of the batch's token positions, and only for
    right padding (what ``trim_padding`` cuts). Each row's embedding is unchanged, as rows never see each other, to
    float rounding: attention then sums over fewer masked keys, which vectorised CPU kernels may add in another order.
    Only for a mask the host reads for free (``host_readable``): on a GPU the choice would take several host syncs,
    and a second pass doubles the kernel launches that bound a batch of captions there.
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

    Captions are padded to the maximum length (64) for fixed shapes, but most are far shorter; keys
    that are masked out contribute nothing, so cutting them changes no output and saves most of the
    text tower's work. Left padding keeps its full width. A tensor without values (fake or meta, as when planning
    a step's memory) is left at its full length: the plan assumes the longest captions; so is one inside a compiled
    graph, which cannot take its shape from values. On a GPU, reading the width is one host sync; pass ``width``
    where it was read already.
    """
    if width is None:
        if not has_values(attention_mask):
            return input_ids, attention_mask
        width = int(tokens_width(attention_mask))
    if width >= attention_mask.shape[1]:
        return input_ids, attention_mask
    return input_ids[:, :width], attention_mask[:, :width]
