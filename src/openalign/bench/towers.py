"""``openalign bench towers``: each tower alone (forward + backward) against its peer, in one run.

The text tower (``encode_text``: validation, padding cut, BERT, projection) against transformers' ``BertModel``
built from the same config and holding the same weights, on the same captions: 6–32 tokens padded to 64, the
collate's layout. Ours takes them as training gives them; the peer both as ALIGN's processor pads them (to 64) and
cut to the batch's longest caption. The image tower against timm's ``efficientnet_bN`` and ``tf_efficientnet_bN``
of the same size (their classifier head, which ALIGN does not build, removed; the same stochastic depth), all
channels-last. Each contender runs in alternating rounds in one process; the figure is the median step.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from openalign.bench.peer import require_baseline
from openalign.config import ModelConfig, model_config
from openalign.model.dual_encoder import DualEncoder
from openalign.model.hf import hf_state_to_ours

TEXT_LENGTH = 64  # the collate pads every caption to the paper's 64 tokens


@dataclass
class TowersBenchSettings:
    """What ``openalign bench towers`` measures."""

    preset: str = "b0-mini"  # model preset: its image and text towers
    towers: Literal["both", "text", "image"] = "both"  # which towers to time
    batch_size: int = 64  # images, and captions, per step
    image_size: int | None = None  # square input size (default: the preset's on cuda, 96 px on cpu)
    vocab_size: int | None = None  # text vocabulary (default: the preset's; BERT's own is 30522)
    steps: int = 3  # timed steps per contender and round
    warmup: int = 1  # untimed steps per contender before the first round
    rounds: int = 3  # alternating rounds; the median over every timed step counts
    device: str = "cpu"  # cpu or cuda
    bf16: bool = False  # bf16 autocast
    # Also time our image tower with torch.backends.cudnn.benchmark on (cuDNN times each convolution's algorithms on
    # its first call and keeps the fastest), as a row of its own: what the setting would buy training on a GPU
    cudnn_benchmark: bool = False
    seed: int = 0  # captions, pixels and weights
    json_path: str | None = None  # also write the results to this JSON file

    def validate(self) -> None:
        if min(self.batch_size, self.steps, self.rounds) < 1 or self.warmup < 0:
            raise ValueError("--batch-size, --steps and --rounds must be positive and --warmup not negative")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")


def captions(batch: int, vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and mask [batch, 64]: ALIGN keeps alt-texts of 3–20 words, about 6–32 wordpieces with [CLS] and
    [SEP], right-padded with id 0."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(min(1000, vocab_size - 1), vocab_size, (batch, TEXT_LENGTH), generator=gen)
    lengths = torch.randint(6, 33, (batch,), generator=gen)
    mask = (torch.arange(TEXT_LENGTH)[None, :] < lengths[:, None]).long()
    ids = ids * mask
    ids[:, 0] = 2
    return ids, mask


def bert_peer(model: DualEncoder) -> nn.Module:
    """transformers' ``BertModel`` (sdpa attention, no pooler: ALIGN projects the raw [CLS] vector) with the text
    tower's config and weights, moved in through the transformers round trip's names."""
    import transformers

    t = model.config.text
    options: dict[str, Any] = {
        "vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size,
        "num_hidden_layers": t.num_layers,
        "num_attention_heads": t.num_heads,
        "intermediate_size": t.ffn_size,
        "hidden_act": "gelu",
        "hidden_dropout_prob": t.hidden_dropout,
        "attention_probs_dropout_prob": t.attention_dropout,
        "max_position_embeddings": t.max_position_embeddings,
        "type_vocab_size": t.type_vocab_size,
        "layer_norm_eps": t.layer_norm_eps,
        "pad_token_id": t.pad_token_id,
        "attn_implementation": "sdpa",
    }
    peer = transformers.BertModel(transformers.BertConfig(**options), add_pooling_layer=False)
    ours = model.state_dict()
    state = peer.state_dict()
    for name in state:
        qkv = _QKV.match(name)
        if qkv:
            layer, part, kind = qkv.groups()
            state[name] = ours[f"text.layers.{layer}.qkv.{kind}"].chunk(3)[("query", "key", "value").index(part)]
            continue
        # the round trip's names, one parameter at a time (the id buffers it skips keep their own values)
        for ours_name in hf_state_to_ours({f"text_model.{name}": state[name]}, model.config):
            state[name] = ours[ours_name]
    peer.load_state_dict(state)
    return peer


_QKV = re.compile(r"encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.(weight|bias)$")


def timm_peers(cfg: ModelConfig, preset: str) -> dict[str, nn.Module]:
    """timm's EfficientNets of the preset's size (``efficientnet_bN`` and, where timm has it,
    ``tf_efficientnet_bN``), empty when timm is not installed. Their 1×1 head convolution and its batch norm are
    removed: ALIGN pools the last stage's features (as ours does), so keeping them would time work ours skips."""
    try:
        timm = importlib.import_module("timm")  # optional: the image rows' peers only
    except ImportError:
        return {}
    size = preset.split("-")[0]
    peers = {}
    for name in (f"efficientnet_{size}", f"tf_efficientnet_{size}"):
        if not timm.is_model(name):
            continue
        net = timm.create_model(name, num_classes=0, drop_path_rate=cfg.image.drop_connect_rate)
        net.conv_head, net.bn2 = nn.Identity(), nn.Identity()
        peers[f"timm {name}"] = net
    return peers


def _time(
    contenders: dict[str, Callable[[], torch.Tensor]], settings: TowersBenchSettings, device: torch.device
) -> dict[str, list[float]]:
    """Seconds of each forward + backward step, contenders in alternating order round by round."""

    def step(forward: Callable[[], torch.Tensor]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=settings.bf16):
            out = forward()
        out.float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    names = list(contenders)
    for name in names:
        for _ in range(settings.warmup):
            step(contenders[name])
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(settings.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name] += [step(contenders[name]) for _ in range(settings.steps)]
    return times


def _zero_grads(*modules: nn.Module) -> Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]:
    """Wrap a forward so that each step starts with no gradients, as a training step does."""

    def wrap(forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            for m in modules:
                m.zero_grad(set_to_none=True)
            return forward()

        return run

    return wrap


def text_contenders(model: DualEncoder, settings: TowersBenchSettings) -> dict[str, Callable[[], torch.Tensor]]:
    device = next(model.parameters()).device
    ids, mask = captions(settings.batch_size, model.config.text.vocab_size, settings.seed)
    longest = int(mask.sum(1).max())
    peer = bert_peer(model).to(device).train()
    ids, mask = ids.to(device), mask.to(device)
    short_ids, short_mask = ids[:, :longest].contiguous(), mask[:, :longest].contiguous()
    ours, theirs = _zero_grads(model.text, model.text_proj), _zero_grads(peer)
    t = model.config.text
    return {
        f"openalign Bert {t.num_layers}x{t.hidden_size}": ours(lambda: model.encode_text(ids, mask)),
        "transformers BertModel, padded to 64": theirs(
            lambda: peer(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
        ),
        f"transformers BertModel, cut to {longest}": theirs(
            lambda: peer(input_ids=short_ids, attention_mask=short_mask).last_hidden_state[:, 0]
        ),
    }


def image_contenders(
    model: DualEncoder, settings: TowersBenchSettings, size: int
) -> dict[str, Callable[[], torch.Tensor]]:
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(settings.seed)
    pixels = (torch.rand(settings.batch_size, 3, size, size, generator=gen) * 2 - 1).to(device)
    pixels = pixels.contiguous(memory_format=torch.channels_last)
    model.image.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # torch's stub omits it
    out = {f"openalign EfficientNet-{settings.preset.split('-')[0].upper()}": _zero_grads(model.image)(
        lambda: model.image(pixels)
    )}  # fmt: skip
    for name, net in timm_peers(model.config, settings.preset).items():
        net.to(device, memory_format=torch.channels_last).train()  # type: ignore[call-overload]
        out[name] = _zero_grads(net)(_calling(net, pixels))
    return out


def _with_cudnn_benchmark(
    contenders: dict[str, Callable[[], torch.Tensor]], settings: TowersBenchSettings, device: torch.device
) -> dict[str, list[float]]:
    """Our image tower (the first contender) timed again with ``torch.backends.cudnn.benchmark`` on; its warm-up
    steps hold cuDNN's algorithm search. The setting is put back as it was."""
    name, ours = next(iter(contenders.items()))
    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    try:
        return {f"{name}, cudnn.benchmark": _time({name: ours}, settings, device)[name]}
    finally:
        torch.backends.cudnn.benchmark = saved


def _calling(net: nn.Module, pixels: torch.Tensor) -> Callable[[], torch.Tensor]:
    def forward() -> torch.Tensor:
        out: torch.Tensor = net(pixels)
        return out

    return forward


def _rows(times: dict[str, list[float]]) -> list[dict[str, Any]]:
    """The first contender is ours; every other row carries ours / its time."""
    medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    ours = next(iter(medians.values()))
    return [
        {"model": name, "median_ms": ms, "steps": len(times[name]), "ratio": None if i == 0 else ours / ms}
        for i, (name, ms) in enumerate(medians.items())
    ]


def run_towers_bench(settings: TowersBenchSettings) -> dict[str, Any]:
    """Time the towers, print ours beside each peer (ratio = our time / the peer's: below 1 is faster), and
    return (and with ``json_path`` write) the figures."""
    settings.validate()
    device = torch.device(settings.device)
    torch.manual_seed(settings.seed)
    cfg = model_config(settings.preset)
    if settings.vocab_size:
        cfg = model_config(cfg, text={"vocab_size": settings.vocab_size})
    size = settings.image_size or (cfg.image_size if device.type == "cuda" else 96)
    model = DualEncoder(cfg).to(device).train()
    results: dict[str, list[dict[str, Any]]] = {}
    if settings.towers in ("both", "text"):
        require_baseline("transformers", "transformers' BertModel", instead="--towers image")
        results["text"] = _rows(_time(text_contenders(model, settings), settings, device))
    if settings.towers in ("both", "image"):
        contenders = image_contenders(model, settings, size)
        times = _time(contenders, settings, device)
        if settings.cudnn_benchmark:
            times |= _with_cudnn_benchmark(contenders, settings, device)
        results["image"] = _rows(times)
        if len(contenders) == 1:
            print("image peers skipped: timm is not installed")
    print(
        f"\nbench towers: {settings.preset}, batch {settings.batch_size}, captions of 6-32 of {TEXT_LENGTH} tokens, "
        f"images {size} px channels-last, {settings.device}{' bf16' if settings.bf16 else ' fp32'}, "
        f"{torch.get_num_threads()} threads, {settings.rounds} rounds x {settings.steps} steps (fwd + bwd)"
    )
    print(f"{'tower':<6} {'model':<42} {'median ms':>10} {'ours/peer':>10}")
    for tower, rows in results.items():
        for row in rows:
            ratio = "" if row["ratio"] is None else f"{row['ratio']:.2f}x"
            print(f"{tower:<6} {row['model']:<42} {row['median_ms']:10.1f} {ratio:>10}")
    summary: dict[str, Any] = {"settings": dataclasses.asdict(settings), "image_size": size, **results}
    if settings.json_path:
        with open(settings.json_path, "w") as f:
            json.dump(summary, f, indent=2)
    return summary
