"""The ALIGN dual encoder: two towers, linear projections into one space, and a learned temperature."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from openalign.config import ModelConfig
from openalign.model.bert import Bert
from openalign.model.captions import bucket_widths, length_buckets, padding_mask, tokens_width, trim_padding
from openalign.model.layers import has_values, host_readable
from openalign.model.towers import image_tower

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

    # ------------------------------------------------------------------ saving and loading

    def save_pretrained(self, path: str | Path, tokenizer: TextTokenizer | None = None) -> Path:
        """Write this model (and ``tokenizer``, if given) as an openalign checkpoint directory."""
        from openalign.model.checkpoint_dir import save_checkpoint

        out = save_checkpoint(path, "dual_encoder", self.config, self.state_dict())
        if tokenizer is not None:
            tokenizer.save(out)
        return out

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, map_location: str | torch.device = "cpu") -> DualEncoder:
        """An openalign or transformers AlignModel directory, or a hub id (``org/name``, ``hf-hub:org/name``)
        from the local Hugging Face cache; in eval mode."""
        from openalign.model.checkpoint_dir import load_dual_encoder
        from openalign.model.hub import resolve

        return load_dual_encoder(resolve(name_or_path), cls, map_location)

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

    def check_tokens(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, read_values: bool = True
    ) -> int | None:
        """Raise on token ids or a mask the model cannot take; return the mask's ``tokens_width``. Values are
        checked only where ``read_values`` and the tensors have values: None is returned otherwise, and without a
        mask."""
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
        if not (read_values and has_values(input_ids)):
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
        x: torch.Tensor = self.image(pixel_values)
        return self.image_proj(x) if self.image_proj is not None else x

    def text_features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        text_groups: list[tuple[torch.Tensor, int]] | None = None,
    ) -> torch.Tensor:
        """Unnormalised text embeddings [B, embed_dim] of the captions as given. ``text_groups``: (row indices,
        width) groups encoded apart, each cut to its width (``captions.bucket_widths``)."""
        out: torch.Tensor = self.text_proj(self.text(input_ids, attention_mask, text_groups))
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
        Padding every row shares is cut first, and on the CPU short captions are encoded apart from long ones
        (``length_buckets``): the embeddings are the same, the work less.
        """
        width = self.check_tokens(input_ids, attention_mask)
        if attention_mask is None:
            attention_mask = padding_mask(input_ids, self.config.text.pad_token_id)
        groups = length_buckets(attention_mask)
        input_ids, attention_mask = trim_padding(input_ids, attention_mask, width if groups is None else None)
        x = self.text_features(input_ids, attention_mask, bucket_widths(attention_mask, groups))
        return F.normalize(x, dim=-1) if normalize else x

    def forward(
        self,
        pixel_values: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        text_groups: list[tuple[torch.Tensor, int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both normalised embeddings, the inputs of ``openalign.loss.contrastive_loss``: training's call.

        The captions are encoded at the width they come in (training cuts them on the host, with its
        ``text_groups``). Token values are checked only where the host reads them for free (the CPU): on an
        accelerator that read would wait for all queued work, so the caller checks them on the host.
        """
        self.check_pixels(pixel_values)
        self.check_tokens(input_ids, attention_mask, read_values=host_readable(input_ids))
        if attention_mask is None:
            attention_mask = padding_mask(input_ids, self.config.text.pad_token_id)
        image = F.normalize(self.image_features(pixel_values), dim=-1)
        return image, F.normalize(self.text_features(input_ids, attention_mask, text_groups), dim=-1)
