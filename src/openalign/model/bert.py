"""BERT (Devlin et al. 2019) as ALIGN's text tower: the last layer's [CLS] vector is the text feature
(or, with ``pooling: mean``, the average of the last layer over the caption's tokens).

Post-LayerNorm encoder identical in function to transformers' BertModel (so its weights load), with a
fused QKV projection and PyTorch's scaled-dot-product attention. There is no pooler: ALIGN projects
the raw [CLS] vector, and an unused parameter would force DDP's find_unused_parameters.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from openalign.config import TextTowerConfig
from openalign.model.layers import has_values, host_readable, maybe_checkpointed


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: TextTowerConfig):
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        # Captions are a single segment, so every token has token type 0.
        x = self.word(input_ids) + self.position.weight[:length] + self.token_type.weight[0]
        out: torch.Tensor = self.dropout(self.norm(x))
        return out


class BertLayer(nn.Module):
    def __init__(self, cfg: TextTowerConfig):
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.ffn_in = nn.Linear(h, cfg.ffn_size)
        self.ffn_out = nn.Linear(cfg.ffn_size, h)
        self.ffn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.attention_dropout = cfg.attention_dropout

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cls_only: bool = False) -> torch.Tensor:
        """``mask`` is additive [B, 1, 1, L]: 0 where a key may be attended, -inf where not. With ``cls_only`` only the
        first position is computed: the last layer's other outputs are never used."""
        b, length, h = x.shape
        heads = self.num_heads
        q, k, v = self.qkv(x).view(b, length, 3, heads, h // heads).permute(2, 0, 3, 1, 4)
        if cls_only:
            q, x = q[:, :, :1], x[:, :1]
        p = self.attention_dropout if self.training else 0.0
        a = attention(q, k, v, mask, p)
        a = a.transpose(1, 2).reshape(b, q.shape[2], h)
        x = self.attn_norm(x + self.dropout(self.attn_out(a)))
        out: torch.Tensor = self.ffn_norm(x + self.dropout(self.ffn_out(F.gelu(self.ffn_in(x)))))
        return out


class Bert(nn.Module):
    """BERT encoder: ``forward`` maps token ids [B, L] and a 0/1 mask to text features [B, hidden]."""

    def __init__(self, cfg: TextTowerConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))
        self.num_features = cfg.hidden_size
        self.gradient_checkpointing = cfg.gradient_checkpointing
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """BERT init: truncated-free N(0, 0.02) weights, zero biases, unit LayerNorm."""
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, 0.0, std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        with torch.no_grad():
            self.embeddings.word.weight[self.cfg.pad_token_id].zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        buckets: list[tuple[torch.Tensor, int]] | None = None,
    ) -> torch.Tensor:
        """``buckets``: (row indices, width) groups whose layers run apart, each cut to its width; the output keeps
        the batch's row order. The embeddings run once for the whole batch: the word table's gradient is dense
        (vocabulary × hidden, 77M values for the paper's 100k wordpieces), and one backward per group would build
        and add it once per group."""
        x: torch.Tensor = self.embeddings(input_ids)
        if buckets is None or attention_mask is None:
            return self._encode(x, attention_mask)
        parts = [self._encode(x[rows, :width], attention_mask[rows, :width]) for rows, width in buckets]
        return torch.cat(parts)[torch.cat([rows for rows, _ in buckets]).argsort()]

    def _encode(self, x: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        mask = None
        if attention_mask is not None and needs_mask(attention_mask):
            mask = additive_mask(attention_mask, attention_dtype(x))
        checkpoint = self.gradient_checkpointing and self.training
        cls_only = self.cfg.pooling == "cls"
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = maybe_checkpointed(checkpoint, layer)(x, mask, cls_only and i == last)
        if cls_only:
            return x[:, 0]
        if attention_mask is None:
            return x.mean(dim=1)
        weights = attention_mask.to(x.dtype).unsqueeze(-1)
        return (x * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)


# Every backend but cuDNN's, whose eager calls cost far more host time than kernel time in a step its host work
# bounds; flash takes the calls without a mask, memory-efficient the rest. Compiled graphs keep PyTorch's choice,
# which is faster there (docs/decisions/attention-backend.md).
_EAGER_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """``scaled_dot_product_attention``, kept off cuDNN's backend in eager CUDA calls (above); compiled graphs
    and other devices choose as PyTorch does."""
    eager_cuda = q.is_cuda and not torch.compiler.is_compiling()
    with sdpa_kernel(_EAGER_CUDA_BACKENDS) if eager_cuda else contextlib.nullcontext():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def needs_mask(attention_mask: torch.Tensor) -> bool:
    """Whether attention must apply ``attention_mask``. A mask of all ones changes nothing, and attention
    without one is faster, but finding out reads its values: free for a CPU tensor, a host sync (a wait for all
    queued work) for an accelerator's, where the mask is applied unread (same result). Without values (a planned
    step) the captions are taken as full length; a compiled graph cannot branch on values and always applies it."""
    if torch.compiler.is_compiling():
        return True
    if not has_values(attention_mask):
        return False
    return not host_readable(attention_mask) or not bool(attention_mask.all())


def attention_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention's queries will have: autocast's where it is on, else the activations'."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def additive_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 1/0 (or boolean) mask [B, L] as the additive bias [B, 1, 1, L] ``scaled_dot_product_attention`` takes:
    0 for keys to attend, -inf for padding. SDPA turns a boolean mask into exactly this, but inside every call:
    three kernels per layer per forward; built once here, in the query's dtype so autocast has nothing to cast.
    On CUDA its rows lie 16 elements apart (the mask is a view of a wider buffer), as memory-efficient attention
    needs them: it would otherwise copy the mask into such a buffer in every call. Elsewhere it is contiguous, as
    the CPU's kernels take it."""
    keep = attention_mask.bool()[:, None, None, :]
    width = keep.shape[-1]
    stride = -(-width // 16) * 16 if keep.is_cuda else width
    padded = torch.zeros((*keep.shape[:-1], stride), dtype=dtype, device=keep.device)
    return padded[..., :width].masked_fill_(~keep, float("-inf"))
