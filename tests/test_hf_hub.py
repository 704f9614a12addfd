"""open_clip-style loading: hub ids from a local Hugging Face cache in the hub's own layout, transforms,
tokenizer, save/from_pretrained. Nothing is downloaded: every socket connection fails in these tests."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import openalign
from conftest import save_tiny_checkpoint
from openalign.config import ConfigError

transformers = pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

from test_hf import _hf_model  # noqa: E402 - after the skip: it needs transformers

REVISION = "0123456789abcdef0123456789abcdef01234567"
CAPTIONS = ["a red circle on green grass", "two blue squares by a circle", "a small red square"]


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network connection attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def hub_cache_with(home: Path, repo: str, hf: transformers.AlignModel) -> Path:
    """``hf`` with an EfficientNet processor (77 px resize, 64 px crop, pixels to [-1, 1]) and a WordPiece
    vocabulary, written as the hub cache lays out a download: snapshots/<revision>/ and refs/main."""
    from openalign.text import train_wordpiece

    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / REVISION
    hf.save_pretrained(snapshot)
    processor = transformers.EfficientNetImageProcessorPil(
        size={"height": 77, "width": 77},
        crop_size={"height": 64, "width": 64},
        rescale_factor=1 / 127.5,
        rescale_offset=True,
        do_normalize=False,
        include_top=False,
        do_center_crop=True,
    )
    processor.save_pretrained(snapshot)
    tokenizer = train_wordpiece(CAPTIONS * 10, vocab_size=90)
    assert tokenizer.vocab_size <= hf.config.text_config.vocab_size
    tokenizer.save(snapshot)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(REVISION)
    return snapshot


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "hf_home"
    home.mkdir()
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return home


def _image(size: tuple[int, int], seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def _unit(x: torch.Tensor | object) -> torch.Tensor:
    features = getattr(x, "pooler_output", x)
    assert isinstance(features, torch.Tensor)
    return F.normalize(features, dim=-1)


@pytest.mark.parametrize("name", ["hf-hub:tiny-org/align-tiny", "tiny-org/align-tiny"])
def test_hub_id_loads_from_the_cache_with_transformers_embeddings(hf_home: Path, name: str) -> None:
    hf = _hf_model(depthwise_padding=(1,))
    snapshot = hub_cache_with(hf_home, "tiny-org/align-tiny", hf)
    model, train_transform, eval_transform = openalign.create_model_and_transforms(name)
    assert not model.training and model.config.image_size == 64

    # The eval transform gives transformers' own processor output (an image already at the 77 px resize).
    image = _image((77, 77))
    processor = transformers.AutoImageProcessor.from_pretrained(snapshot)
    theirs = processor(images=image, return_tensors="pt")["pixel_values"]
    ours = eval_transform(image).unsqueeze(0)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert train_transform(image).shape == ours.shape[1:]

    tokenizer = openalign.get_tokenizer(name)
    ids = tokenizer(CAPTIONS)
    assert ids.dtype == torch.long and ids.shape == (3, model.config.text.max_length)
    hf_tokens = transformers.AutoTokenizer.from_pretrained(snapshot)(CAPTIONS, padding=True, return_tensors="pt")
    with torch.no_grad():
        image_emb, text_emb = model.encode_image(ours), model.encode_text(ids)
        hf_image = _unit(hf.get_image_features(pixel_values=theirs))
        hf_text = _unit(hf.get_text_features(**hf_tokens))
    torch.testing.assert_close(image_emb, hf_image, rtol=0, atol=1e-5)
    torch.testing.assert_close(text_emb, hf_text, rtol=0, atol=1e-5)

    again = openalign.DualEncoder.from_pretrained(name)
    for key, value in model.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key


def test_uncached_hub_id_is_one_line_saying_how_to_fetch_it(hf_home: Path) -> None:
    from openalign.model.hub import download_command

    with pytest.raises(FileNotFoundError) as caught:
        openalign.create_model_and_transforms("kakaobrain/align-base")
    message = str(caught.value)
    assert "\n" not in message
    assert f"is not in the local Hugging Face cache (HF_HOME={hf_home})" in message
    assert message.endswith(f"fetch it with: {download_command('kakaobrain/align-base')}")
    assert re.fullmatch(r"(hf|huggingface-cli) download org/x", download_command("org/x"))
    with pytest.raises(FileNotFoundError, match=r"^kakaobrain/align-base is not in the local"):
        openalign.DualEncoder.from_pretrained("hf-hub:kakaobrain/align-base")
    # another model cached under HF_HOME does not stand in for the one asked for
    hub_cache_with(hf_home, "tiny-org/align-tiny", _hf_model())
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        openalign.get_tokenizer("hf-hub:tiny-org/align-other")


def test_cache_without_the_snapshot_refs_point_to_is_not_cached(hf_home: Path) -> None:
    snapshot = hub_cache_with(hf_home, "tiny-org/align-tiny", _hf_model())
    (snapshot.parent.parent / "refs" / "main").write_text("f" * 40)
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        openalign.create_model_and_transforms("hf-hub:tiny-org/align-tiny")


def test_an_empty_refs_main_is_one_line_naming_it(hf_home: Path) -> None:
    snapshot = hub_cache_with(hf_home, "tiny-org/align-tiny", _hf_model())
    ref = snapshot.parent.parent / "refs" / "main"
    ref.write_text("")
    with pytest.raises(FileNotFoundError) as caught:
        openalign.create_model_and_transforms("hf-hub:tiny-org/align-tiny")
    assert str(caught.value).startswith(f"{ref}: empty, so it names no snapshot of tiny-org/align-tiny")


def test_hub_cache_env_wins_over_hf_home(tmp_path: Path, hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "elsewhere"
    hub_cache_with(elsewhere, "tiny-org/align-tiny", _hf_model())
    with pytest.raises(FileNotFoundError):
        openalign.DualEncoder.from_pretrained("tiny-org/align-tiny")
    monkeypatch.setenv("HF_HUB_CACHE", str(elsewhere / "hub"))
    assert openalign.DualEncoder.from_pretrained("tiny-org/align-tiny").config.image_size == 64


def test_a_missing_local_path_is_not_mistaken_for_a_preset_or_read(hf_home: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"^runs/final: no such directory, and it is not in the local"):
        openalign.create_model_and_transforms("runs/final")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        openalign.create_model_and_transforms("runs/nano/final")


def test_preset_transforms_are_the_papers_crops_at_the_models_size() -> None:
    model, train_transform, eval_transform = openalign.create_model_and_transforms("nano")
    assert model.config.image_size == 64 and not model.training
    image = _image((120, 90), seed=3)
    # 64 px crops of a 77 px square bicubic resize (346/289 of the input size), pixels to [-1, 1]
    resized = image.resize((77, 77), Image.Resampling.BICUBIC, reducing_gap=3.0)
    full = torch.from_numpy(np.asarray(resized).copy()).permute(2, 0, 1).float() / 127.5 - 1
    torch.testing.assert_close(eval_transform(image), full[:, 6:70, 6:70], rtol=0, atol=1e-6)
    torch.manual_seed(0)
    seen = set()
    for _ in range(12):
        out = train_transform(image)
        matches = [
            (top, left, flip)
            for top in range(14)
            for left in range(14)
            for flip in (False, True)
            # Training crops are resized by torch's kernels: PIL's filter, within 2 levels of 255.
            if torch.allclose(
                out, (lambda c: c.flip(-1) if flip else c)(full[:, top : top + 64, left : left + 64]), atol=2.01 / 127.5
            )
        ]
        assert len(matches) == 1, matches
        seen.add(matches[0])
    assert len(seen) > 1 and {flip for *_, flip in seen} == {False, True}
    with torch.no_grad():
        assert model.encode_image(torch.stack([eval_transform(image)])).shape == (1, model.embed_dim)


def test_save_and_from_pretrained_round_trip_with_tokenizer(tmp_path: Path, tiny_model) -> None:
    from openalign.text import train_wordpiece

    tokenizer = train_wordpiece(CAPTIONS * 10, vocab_size=90, max_length=16)
    tiny_model.eval().save_pretrained(tmp_path / "m", tokenizer=tokenizer)
    loaded = openalign.DualEncoder.from_pretrained(tmp_path / "m")
    model, _, eval_transform = openalign.create_model_and_transforms(str(tmp_path / "m"))
    tok = openalign.get_tokenizer(tmp_path / "m")
    ids = tok(CAPTIONS)
    assert ids.shape == (3, 16) and bool((ids == tok.pad_id).any())
    with torch.no_grad():
        masked = tiny_model.encode_text(**tokenizer(CAPTIONS))
        for m in (loaded, model):
            torch.testing.assert_close(m.encode_text(ids), masked, rtol=0, atol=1e-6)
        # without the mask the padding would be attended to: the derived mask is what makes them equal
        attended = tiny_model.encode_text(ids, torch.ones_like(ids))
    assert not torch.allclose(attended, masked, atol=1e-3)
    assert eval_transform(_image((40, 50))).shape == (3, 32, 32)


def test_preset_with_pretrained_weights_checks_the_shapes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    nano = openalign.create_model("nano")
    nano.save_pretrained(tmp_path / "nano")
    model, _, _ = openalign.create_model_and_transforms("nano", pretrained=str(tmp_path / "nano"))
    for key, value in nano.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key
    save_tiny_checkpoint(tmp_path / "tiny", CAPTIONS * 10, vocab_size=90)
    with pytest.raises(ConfigError, match=r"does not fit preset nano: image\.stem\.conv\.weight has shape"):
        openalign.create_model_and_transforms("nano", pretrained=str(tmp_path / "tiny"))
    with pytest.raises(ConfigError, match="random weights and no vocabulary"):
        openalign.get_tokenizer("nano")


def test_readme_python_example_runs_on_a_cached_hub_model(
    hf_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from readme_utils import README, _section

    code = re.search(r"```python\n(.*?)```", _section(README.read_text(), "## Python API"), re.S)
    assert code is not None
    hub_cache_with(hf_home, "kakaobrain/align-base", _hf_model())
    monkeypatch.chdir(tmp_path)
    _image((120, 100)).convert("L").save("cat.jpg")  # a grey JPEG: the transform makes it RGB
    exec(compile(code.group(1), "README.md", "exec"), {})
    probs = torch.tensor([[float(x) for x in re.findall(r"\d\.\d+(?:e-?\d+)?", capsys.readouterr().out)]])
    assert probs.shape == (1, 2)
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0), atol=1e-3, rtol=0)
