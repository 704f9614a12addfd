"""Training configs: the paper's recipes as shipped, strict loading and overrides, the `train` command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import openalign
from openalign.cli import main
from openalign.config import ConfigError, ModelConfig, validate
from openalign.train.config import TrainConfig, list_recipes, load_train_config, parse_overrides

SHARDS = {"data.shards": "shards/{00000..00009}.tar", "data.tokenizer": "vocab"}


def test_packaged_recipes() -> None:
    assert set(list_recipes()) >= {
        "pretrain_align",
        "pretrain_align_b7",
        "pretrain_align_mling",
        "nano_cpu",
        "finetune_flickr30k",
        "finetune_mscoco",
    }


def test_pretrain_recipe_is_the_papers() -> None:
    cfg = load_train_config("pretrain_align", SHARDS)
    o, t, d = cfg.optim, cfg.train, cfg.data
    assert (o.name, o.lr, o.weight_decay, o.betas, o.eps) == ("lamb", 1e-3, 1e-5, (0.9, 0.999), 1e-6)
    assert (o.schedule, o.warmup_steps, o.total_steps) == ("warmup_linear_decay", 10_000, 1_200_000)
    assert (t.batch_size, t.label_smoothing, cfg.total_steps) == (16384, 0.1, 1_200_000)
    assert (d.image_size, d.resize, d.crop, d.flip, d.max_text_length) == (289, 346, "random", True, 64)
    model = cfg.model.resolve()
    assert cfg.model.preset == "l2-large" and model.embed_dim == 1376 and model.temperature_init == 1.0
    assert model.text.num_layers == 24 and model.image.width_coefficient == 4.3
    # 16 pairs per TPU core with per-core statistics: ghost batch norm of 16.
    assert (model.image.batch_norm, model.image.virtual_batch_size) == ("virtual", 16)
    # The same global batch on 1024 "cores" gives each 16 pairs; on 8 GPUs 2048.
    assert cfg.per_rank_batch(1024) == 16 and cfg.per_rank_batch(8) == 2048

    b7 = load_train_config("pretrain_align_b7", SHARDS)
    assert b7.model.resolve().embed_dim == 640 and b7.optim.lr == 1e-3 and b7.train.batch_size == 16384


@pytest.mark.parametrize(("name", "steps"), [("finetune_flickr30k", 3000), ("finetune_mscoco", 6000)])
def test_finetune_recipes(name: str, steps: int) -> None:
    cfg = load_train_config(name, {"model.init": "ckpt", "data.shards": "x.tar", "data.tokenizer": "ckpt"})
    assert cfg.train.batch_size == 2048 and cfg.train.label_smoothing == 0.1
    assert (cfg.optim.lr, cfg.optim.total_steps, cfg.optim.schedule) == (1e-5, steps, "warmup_linear_decay")
    assert cfg.model.init == "ckpt"
    with pytest.raises(ConfigError, match=r"model\.init is empty"):
        load_train_config(name, {"data.shards": "x.tar"})


def test_nano_recipe_loads_and_uses_the_synthetic_world() -> None:
    cfg = load_train_config("nano_cpu")
    assert cfg.data.source == "synthetic" and cfg.model.resolve().name == "nano"
    assert cfg.optim.lr_scales == {"temperature_param": 10.0}


def test_lr_scale_prefixes_survive_overrides() -> None:
    """A module prefix such as "text." is one key of optim.lr_scales, whether it comes from YAML or a flag."""
    over = parse_overrides(["--optim.lr_scales", '{"text.": 5.0, "image_proj.weight": 0.5}'])
    cfg = load_train_config("nano_cpu", over)
    assert cfg.optim.lr_scales == {"temperature_param": 10.0, "text.": 5.0, "image_proj.weight": 0.5}


def test_overrides_are_typed_and_strict() -> None:
    over = parse_overrides(
        ["--train.grad_clip", "1.0", "--model.image.batch_norm=virtual", "--train.steps", "5", "--data.seed", "null"]
    )
    assert over == {"train.grad_clip": 1.0, "model.image.batch_norm": "virtual", "train.steps": 5, "data.seed": None}
    cfg = load_train_config("nano_cpu", over)
    assert cfg.train.grad_clip == 1.0 and cfg.train.steps == 5 and cfg.total_steps == 5
    assert cfg.model.resolve().image.batch_norm == "virtual"

    with pytest.raises(ConfigError, match=r"unknown config key 'train.stepz'.*valid keys in train:.*steps"):
        load_train_config("nano_cpu", {"train.stepz": 5})
    with pytest.raises(ConfigError, match=r"unknown config key 'model.image.batchnorm'"):
        load_train_config("nano_cpu", {"model.image.batchnorm": "virtual"})
    with pytest.raises(ConfigError, match="unknown config section 'trian'"):
        load_train_config("nano_cpu", {"trian.steps": 5})
    with pytest.raises(ConfigError, match=r"train\.steps: expected an integer"):
        load_train_config("nano_cpu", {"train.steps": "many"})
    with pytest.raises(ConfigError, match=r"train\.precision: 'fp8' is not one of"):
        load_train_config("nano_cpu", {"train.precision": "fp8"})
    with pytest.raises(ConfigError, match="optim: unknown optimizer 'adam'"):
        load_train_config("nano_cpu", {"optim.name": "adam"})
    with pytest.raises(ConfigError, match="needs a value"):
        parse_overrides(["--train.steps"])
    with pytest.raises(ConfigError, match="section and a key"):
        parse_overrides(["--steps", "3"])


def test_batch_splitting_is_checked() -> None:
    cfg = load_train_config("nano_cpu", {"train.batch_size": 100, "train.chunk_size": 25})
    assert cfg.per_rank_batch(1) == 100 and cfg.per_rank_batch(4) == 25
    with pytest.raises(ConfigError, match="does not split evenly over 3 ranks"):
        cfg.per_rank_batch(3)
    with pytest.raises(ConfigError, match="chunk_size 30 does not divide the per-rank batch 50"):
        load_train_config("nano_cpu", {"train.batch_size": 100, "train.chunk_size": 30}).per_rank_batch(2)
    # Without train.batch_size the data section's per-rank batch is used as is.
    assert load_train_config("nano_cpu", {"data.batch_size": 12}).per_rank_batch(2) == 12


def test_config_round_trips_through_yaml(tmp_path: Path) -> None:
    cfg = load_train_config("nano_cpu", {"model.embed_dim": 64, "train.grad_clip": 2.0})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    again = load_train_config(path)
    assert again == cfg and isinstance(again, TrainConfig)


def test_cli_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--config", "nano_cpu", "--train.stepz", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("openalign train: error: unknown config key 'train.stepz'") and "\n" not in err
    assert main(["train", "--config", "missing.yaml"]) == 2
    assert "no such config file" in capsys.readouterr().err
    assert main(["train", "--config", "nano_cpu", "--print-config", "--train.steps", "7"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["steps"] == 7 and printed["model"]["preset"] == "nano"


def test_cli_help_has_examples() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "openalign.cli", "train", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "examples:" in out and "--resume latest" in out and "torchrun" in out


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("optim.lr", ".inf", r"optim\.lr: expected a finite number, got inf"),
        ("optim.lr", ".nan", r"optim\.lr: expected a finite number, got nan"),
        ("optim.lr", "0", r"optim: lr must be finite and > 0, got 0"),
        ("optim.lr", "-1", r"optim: lr must be finite and > 0, got -1"),
        ("optim.weight_decay", ".nan", r"optim\.weight_decay: expected a finite number, got nan"),
        ("optim.weight_decay", "-1", r"optim: weight_decay must be finite and >= 0, got -1"),
        ("optim.eps", ".inf", r"optim\.eps: expected a finite number, got inf"),
        ("model.temperature_init", ".inf", r"model\.temperature_init: expected a finite number, got inf"),
        ("model.temperature_init", "0", r"temperature_init must be positive, got 0"),
        ("train.label_smoothing", ".nan", r"train\.label_smoothing: expected a finite number, got nan"),
        ("train.grad_clip", ".inf", r"train\.grad_clip: expected a finite number, got inf"),
        ("train.checkpoint_minutes", ".nan", r"train\.checkpoint_minutes: expected a finite number, got nan"),
        ("data.synthetic.noise", ".nan", r"data\.synthetic\.noise: expected a finite number, got nan"),
    ],
)
def test_non_finite_or_out_of_range_numbers_are_one_line_config_errors(
    key: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load_train_config("nano_cpu", parse_overrides([f"--{key}", value]))
    assert "\n" not in str(info.value)
    assert main(["train", "--config", "nano_cpu", f"--{key}", value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("openalign train: error: ") and "\n" not in err


def test_direct_construction_checks_numbers_too() -> None:
    """Python callers that skip YAML still meet the checks: the config objects validate themselves."""
    cfg = load_train_config("nano_cpu")
    cfg.train.grad_clip = float("inf")
    with pytest.raises(ConfigError, match=r"train\.grad_clip must be positive and finite"):
        cfg.validate()
    cfg.train.grad_clip, cfg.train.checkpoint_minutes = None, float("nan")
    with pytest.raises(ConfigError, match=r"train\.checkpoint_minutes must be finite"):
        cfg.validate()
    with pytest.raises(ConfigError, match="temperature_init must be positive, got nan"):
        validate(ModelConfig(temperature_init=float("nan")))
    with pytest.raises(ConfigError, match="temperature_init: expected a finite number, got inf"):
        openalign.create_model("nano", temperature_init=float("inf"))


def test_train_with_an_infinite_lr_exits_with_one_line(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "openalign.cli", "train", "--config", "nano_cpu", "--optim.lr", ".inf"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == "openalign train: error: optim.lr: expected a finite number, got inf"
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("precision", "device", "family", "amx", "capability", "expected"),
    [
        ("auto", "cuda", "convnet", False, (9, 0), "bf16"),
        ("auto", "cuda:1", "efficientnet", True, (8, 0), "bf16"),
        # a V100 or T4 emulates bf16, slower than fp32, and cuDNN has no bf16 convolutions for it
        ("auto", "cuda", "efficientnet", False, (7, 5), "fp32"),
        ("auto", "cuda:1", "convnet", True, (7, 0), "fp32"),
        ("bf16", "cuda", "efficientnet", False, (7, 5), "bf16"),  # asked for: done, with a warning (the loop's)
        ("auto", "cpu", "convnet", True, (7, 5), "bf16-image"),
        ("auto", "cpu", "convnet", False, None, "fp32"),
        # the EfficientNet's depthwise convolutions ran slower in bf16 on an AMX CPU too
        ("auto", "cpu", "efficientnet", True, None, "fp32"),
        ("fp32", "cpu", "convnet", True, None, "fp32"),
        ("bf16", "cpu", "convnet", False, None, "bf16"),
        ("bf16-image", "cpu", "efficientnet", False, None, "bf16-image"),
    ],
)
def test_precision_auto_is_bf16_on_a_gpu_computing_in_it_and_the_image_tower_in_bf16_on_an_amx_cpu(
    monkeypatch: pytest.MonkeyPatch,
    precision: str,
    device: str,
    family: str,
    amx: bool,
    capability: tuple[int, int] | None,
    expected: str,
) -> None:
    import openalign.train.config as train_config

    monkeypatch.setattr(train_config, "cpu_has_amx", lambda: amx)
    asked: list[object] = []
    if capability is not None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: asked.append(d) or capability)
    assert train_config.resolve_precision(precision, device, family) == expected
    assert train_config.resolve_precision(precision, torch.device(device), family) == expected
    if precision == "auto" and device.startswith("cuda"):
        assert asked == [torch.device(device)] * 2  # the device the run trains on, not the current one
        # The plan names its GPU: what this machine holds does not matter.
        assert train_config.resolve_precision(precision, "cuda", family, gpu_bf16=True) == "bf16"
        assert train_config.resolve_precision(precision, "cuda", family, gpu_bf16=False) == "fp32"
    else:
        assert not asked


def test_gpus_without_bfloat16_hardware_are_said_once_in_a_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import openalign.hardware as hardware
    import openalign.train.loop as loop

    monkeypatch.setattr(torch.version, "hip", None)
    for capability, native in [((6, 1), False), ((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=capability: c)
        assert hardware.cuda_computes_bfloat16("cuda:0") is native
    monkeypatch.setattr(torch.version, "hip", "6.2")  # AMD's GPUs under ROCm compute in bf16
    assert hardware.cuda_computes_bfloat16("cuda:0")

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla T4")
    gpu = torch.device("cuda:0")
    loop._say_precision_on_an_older_gpu(gpu, "auto", "fp32")
    loop._say_precision_on_an_older_gpu(gpu, "bf16", "bf16")
    loop._say_precision_on_an_older_gpu(gpu, "fp32", "fp32")  # nothing to say
    assert capsys.readouterr().err.splitlines() == [
        "precision auto: fp32, as the Tesla T4 (compute capability 7.5) has no bfloat16 hardware",
        "warning: train.precision bf16: the Tesla T4 (compute capability 7.5) has no bfloat16 hardware, so its "
        "bf16 is emulated, slower than fp32, and cuDNN may have no bf16 convolutions for it; train.precision auto "
        "or fp32 computes in fp32",
    ]


def test_cpu_features_come_from_the_kernels_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    import openalign.hardware as hardware

    for flags, bf16_dot, amx in [
        (set(), False, False),
        ({"avx512f", "avx512_bf16"}, True, False),
        ({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, True, True),
    ]:
        monkeypatch.setattr(hardware, "cpu_flags", lambda flags=flags: frozenset(flags))
        monkeypatch.setattr(torch.cpu, "_init_amx", lambda: True, raising=False)
        assert (hardware.cpu_has_bfloat16_dot(), hardware.cpu_has_amx()) == (bf16_dot, amx)
    # A kernel that refuses this process AMX's tile registers leaves it without AMX, whatever the flags say.
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: False, raising=False)
    assert hardware.cpu_has_bfloat16_dot() and not hardware.cpu_has_amx()
