"""open_clip-style entry points: one name gives the model, its train and eval transforms, and its tokenizer.

A name is a preset (``openalign.list_presets()``; random weights unless ``pretrained`` names a checkpoint), an
openalign checkpoint directory, a transformers AlignModel directory, or a hub id (``org/name`` or
``hf-hub:org/name``) already in the local Hugging Face cache. The transforms are the paper's: resize to
346/289 of the model's input size, then a random crop and horizontal flip to train, the centre crop to
evaluate, scaled by the model's own pixel mean and std (a transformers checkpoint's preprocessor config).
"""

from __future__ import annotations

from pathlib import Path

import torch

from openalign.config import ConfigError, ModelConfig, list_presets, model_config
from openalign.data.transforms import Transform, model_transform
from openalign.model.checkpoint_dir import architecture, read_config
from openalign.model.dual_encoder import DualEncoder
from openalign.model.hub import resolve
from openalign.model.io import load_model
from openalign.model.weights import first_mismatch
from openalign.text.tokenizer import IdTokenizer, load_tokenizer

__all__ = ["create_model_and_transforms", "get_tokenizer", "load_pretrained", "model_config_of"]


def _is_preset(name: str | Path) -> bool:
    return isinstance(name, str) and not Path(name).exists() and name in list_presets()


def model_config_of(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory (openalign or transformers), without reading its weights."""
    meta = read_config(path)
    if meta.get("model_type") == "align":
        from openalign.model.hf import hf_model_config

        return hf_model_config(path, meta)
    kind, config = architecture(meta, path)
    if kind != "dual_encoder":
        raise ConfigError(f"{path} holds a copy detector, not an ALIGN dual encoder")
    return model_config(config)


def load_pretrained(name_or_path: str | Path, map_location: str | torch.device = "cpu") -> DualEncoder:
    """A dual encoder from a directory or a cached hub id, in eval mode."""
    return load_model(resolve(name_or_path), map_location=map_location)


def create_model_and_transforms(
    name_or_path: str | Path,
    pretrained: str | Path | None = None,
    device: str | torch.device | None = None,
) -> tuple[DualEncoder, Transform, Transform]:
    """``(model, train_transform, eval_transform)``, the model in eval mode on ``device``.

    The transforms take a PIL image and return the float tensor [3, S, S] that ``model.encode_image`` takes
    (stack them for a batch). With a preset name and ``pretrained`` (a directory or hub id), the weights come
    from ``pretrained``, whose shapes must be the preset's: a mismatch is one line naming the first tensor.
    """
    if _is_preset(str(name_or_path)):
        name = str(name_or_path)
        if pretrained is None:
            model = DualEncoder(model_config(name)).eval()
        else:
            model = load_pretrained(pretrained)
            with torch.device("meta"):  # only the shapes: a B7 preset costs nothing to compare against
                expected = DualEncoder(model_config(name)).state_dict()
            problem = first_mismatch(expected, model.state_dict())
            if problem is not None:
                raise ConfigError(f"{pretrained} does not fit preset {name}: {problem}")
    else:
        if pretrained is not None:
            raise ConfigError(
                f"pretrained={str(pretrained)!r} goes with a preset name; {name_or_path} already names the weights"
            )
        model = load_pretrained(name_or_path)
    if device is not None:
        model = model.to(device)
    return model, model_transform(model.config, train=True), model_transform(model.config, train=False)


def get_tokenizer(name_or_path: str | Path) -> IdTokenizer:
    """The tokenizer saved with a checkpoint directory or cached hub model, as an :class:`IdTokenizer`:
    ``tok(list_of_captions)`` is a LongTensor [B, L] of ids ([PAD] after each caption, L the model's
    ``text.max_length``) that ``model.encode_text`` takes as it is."""
    if _is_preset(str(name_or_path)):
        raise ConfigError(
            f"preset {name_or_path} has random weights and no vocabulary; give the checkpoint directory or hub id "
            "that holds the tokenizer (tokenizer.json or vocab.txt)"
        )
    path = resolve(name_or_path)
    cfg = model_config_of(path)
    tokenizer = load_tokenizer(path, max_length=cfg.text.max_length)
    if tokenizer.pad_id != cfg.text.pad_token_id:
        raise ConfigError(
            f"{name_or_path}: the tokenizer pads with id {tokenizer.pad_id} but the model's text.pad_token_id is "
            f"{cfg.text.pad_token_id}"
        )
    return IdTokenizer(tokenizer)
