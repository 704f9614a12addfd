"""The training loop on a tiny model and an in-memory stream: steps, NaN guard, clipping, caching, init."""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import openalign
from conftest import declare_accelerator, tiny_overrides
from openalign.train.checkpoint import list_checkpoints, load_trainer_state
from openalign.train.config import load_train_config
from openalign.train.loop import NonFiniteError, train
from openalign.train.step import BufferSnapshot

NO_DROPOUT = {"text": {"hidden_dropout": 0.0, "attention_dropout": 0.0}, "image": {"drop_connect_rate": 0.0}}


class MemoryStream:
    """The TrainStream protocol over a deterministic global sequence of samples.

    Sample ``i`` is a function of ``i`` alone; step ``s`` takes the next ``world_size × batch_size`` samples
    and rank ``r`` gets samples ``r, r + W, …`` of them, so the position is one global number. ``poison``
    lists global batch numbers whose pixels are NaN, ``skip`` global batch numbers left out; ``block_after``
    makes the stream hang (a stalled data source) once that many batches were handed out; ``seen`` records
    the first sample of every batch.
    """

    pixels = None  # its pixels are the model's input already

    def __init__(
        self,
        cfg: Any,
        tokenizer: Any = None,
        *,
        rank: int,
        world_size: int,
        seed: int,
        model_config: Any = None,
        poison: tuple[int, ...] = (),
        skip: tuple[int, ...] = (),
        block_after: int | None = None,
        blocked: bool = False,
        classes: int | None = None,
    ):
        self.batch, self.rank, self.world = cfg.batch_size, rank, world_size
        self.size = model_config.image_size if model_config is not None else 32
        self.position = 0
        self.stats: Counter[str] = Counter()
        self.poison, self.skip, self.block_after = set(poison), set(skip), block_after
        self.classes = classes  # a learnable world: sample i shows pattern i % classes, captioned by that class
        self.blocked = blocked  # rank r takes a contiguous block of each global batch instead of every W-th sample
        self.seen: list[int] = []

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.classes is not None:
            c = i % self.classes
            pattern = torch.randn(3, self.size, self.size, generator=torch.Generator().manual_seed(c))
            noise = torch.randn(3, self.size, self.size, generator=torch.Generator().manual_seed(1000 + i))
            ids = torch.zeros(12, dtype=torch.long)
            ids[:3] = torch.tensor([2, 5 + c, 3])
            return pattern + 0.3 * noise, ids
        g = torch.Generator().manual_seed(1000 + i)
        pixels = torch.randn(3, self.size, self.size, generator=g)
        length = int(torch.randint(3, 12, (), generator=g))
        ids = torch.zeros(12, dtype=torch.long)
        ids[:length] = torch.randint(5, 101, (length,), generator=g)
        return pixels, ids

    def __iter__(self):
        handed = 0
        while True:
            number = self.position // (self.batch * self.world)
            if number in self.skip:
                self.position += self.batch * self.world
                continue
            if self.block_after is not None and handed >= self.block_after:
                import time

                time.sleep(600)
            if self.blocked:
                indices = [self.position + self.rank * self.batch + j for j in range(self.batch)]
            else:
                indices = [self.position + self.rank + self.world * j for j in range(self.batch)]
            self.seen.append(indices[0])
            pixels, ids = zip(*(self.sample(i) for i in indices), strict=True)
            pixel_values = torch.stack(pixels)
            if number in self.poison:
                pixel_values[0, 0, 0, 0] = float("nan")
            self.position += self.batch * self.world
            handed += 1
            input_ids = torch.stack(ids)
            yield {"pixel_values": pixel_values, "input_ids": input_ids, "attention_mask": (input_ids > 0).long()}

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "stats": dict(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
        self.stats = Counter(state.get("stats") or {})


def factory(**options: Any):
    """A stream factory with extra options that also remembers the streams it built."""
    built: list[MemoryStream] = []

    def make(*args: Any, **kwargs: Any) -> MemoryStream:
        stream = MemoryStream(*args, **kwargs, **options)
        built.append(stream)
        return stream

    make.built = built  # type: ignore[attr-defined]
    return make


def tiny_config(run_dir: Path | str, model: dict | None = None, **sections: dict) -> Any:
    base: dict[str, Any] = {
        "model": {"preset": "nano", **tiny_overrides(**(model or {}))},
        "data": {"source": "shards", "shards": "in-memory", "batch_size": 8},
        "optim": {"lr": 1e-3, "warmup_steps": 2, "total_steps": 6},
        "train": {"run_dir": str(run_dir), "device": "cpu", "checkpoint_every": 0, "checkpoint_minutes": 0},
        "log": {"every": 1},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return load_train_config(base)


# Other processes share these cores; intra-op threads would only contend.
pytestmark = pytest.mark.usefixtures("one_thread")


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


def test_run_trains_saves_final_model_and_prunes_checkpoints(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path / "run", train={"checkpoint_every": 2, "keep_checkpoints": 2})
    make = factory()
    result = train(cfg, stream_factory=make)
    assert result.step == 6 and result.skipped_steps == 0
    # Final model loads with the public API and equals the last checkpoint.
    model = openalign.load_model(result.final_dir)
    final = weights(result.final_dir)
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [4, 6]
    last = weights(tmp_path / "run" / "checkpoints" / "step_0000006")
    assert all(torch.equal(final[k], last[k]) for k in final)
    assert model.config.embed_dim == 24
    # The weights moved away from their initialisation, and every step consumed one batch.
    torch.manual_seed(0)
    init = openalign.create_model(model.config).state_dict()
    assert not torch.equal(init["text_proj.weight"], final["text_proj.weight"])
    assert make.built[0].position == 6 * 8
    assert math.isfinite(result.metrics["loss"]) and result.metrics["lr"] > 0
    assert (tmp_path / "run" / "config.yaml").is_file()


def test_the_saved_model_cuts_captions_where_training_cut_them(tmp_path: Path) -> None:
    # The model's preset reads 16 wordpieces; training read 12, so evaluation and serving must read 12 too.
    cfg = tiny_config(tmp_path / "run", data={"max_text_length": 12}, optim={"total_steps": 1})
    assert cfg.model.resolve().text.max_length == 16
    result = train(cfg, stream_factory=factory())
    assert openalign.load_model(result.final_dir).config.text.max_length == 12


def test_a_resumed_run_counts_the_time_of_the_process_before_it(tmp_path: Path) -> None:
    first = train(tiny_config(tmp_path, optim={"total_steps": 2}), stream_factory=factory())
    state, _ = load_trainer_state(tmp_path / "checkpoints" / "step_0000002")
    assert 0 < state["seconds"] <= first.seconds
    start = time.perf_counter()
    resumed = train(tiny_config(tmp_path, optim={"total_steps": 4}), resume="latest", stream_factory=factory())
    elapsed = time.perf_counter() - start
    assert resumed.step == 4
    # Longer than this process took: the first process's time to its checkpoint is added.
    assert resumed.seconds > elapsed and resumed.seconds <= state["seconds"] + elapsed


def test_the_loop_learns_a_learnable_world(tmp_path: Path) -> None:
    """Captions name one of 8 image patterns: the loss must fall far below its chance level (2 ln 8)."""
    cfg = tiny_config(
        tmp_path / "run",
        model={"temperature_init": 0.1},  # a sharp start; at 1.0 the tiny model spends its steps on the temperature
        optim={"name": "adamw", "lr": 1e-2, "warmup_steps": 5, "total_steps": 60},
        log={"every": 5},
    )
    train(cfg, stream_factory=factory(classes=8))
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    chance = 2 * math.log(8)  # both directions at a uniform softmax over 8 candidates
    assert losses[0] > 0.9 * chance
    assert sum(losses[-3:]) / 3 < 0.5 * chance, losses


def test_nan_batch_is_skipped_as_if_it_never_came(tmp_path: Path) -> None:
    """A poisoned step changes nothing: weights equal a run whose stream simply left that batch out."""
    cfg_a = tiny_config(tmp_path / "a", model=NO_DROPOUT)
    cfg_b = tiny_config(tmp_path / "b", model=NO_DROPOUT)
    poisoned = train(cfg_a, stream_factory=factory(poison=(2, 3)))
    clean = train(cfg_b, stream_factory=factory(skip=(2, 3)))
    assert poisoned.skipped_steps == 2 and clean.skipped_steps == 0
    assert poisoned.step == clean.step == 6
    a, b = weights(poisoned.final_dir), weights(clean.final_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.isfinite(v.float()).all() for v in a.values())


def test_buffer_snapshot_puts_back_every_buffer_with_one_copy_per_dtype() -> None:
    """Batch norm's float statistics and int64 counters, snapshotted in lists of one dtype each (CUDA's foreach copy
    takes a list of mixed dtypes tensor by tensor), and put back exactly after a poisoned forward."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.BatchNorm2d(4)).train()
    model(torch.randn(2, 3, 8, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    snapshot = BufferSnapshot(model.buffers())
    assert sorted(str(g[0].dtype) for g in snapshot.live) == ["torch.float32", "torch.int64"]
    assert all(len({t.dtype for t in group}) == 1 for group in snapshot.live + snapshot.saved)
    assert sum(map(len, snapshot.live)) == len(list(model.buffers()))
    snapshot.take()
    model(torch.full((2, 3, 8, 8), float("nan")))  # running statistics NaN, counters one up
    assert not torch.equal(model.state_dict()["1.num_batches_tracked"], before["1.num_batches_tracked"])
    snapshot.restore()
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_nan_guard_aborts_after_k_in_a_row_and_keeps_the_last_good_state(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path / "run", train={"max_bad_steps": 3})
    with pytest.raises(NonFiniteError, match=r"3 consecutive steps .*\(last good step 2\)"):
        train(cfg, stream_factory=factory(poison=tuple(range(2, 100))))
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [2]


def test_gradient_clipping_bounds_the_update(tmp_path: Path) -> None:
    """Plain SGD at lr 1 moves the weights by exactly the clipped gradient, whose norm is grad_clip."""
    clip = 1e-3
    cfg = tiny_config(
        tmp_path / "run",
        model=NO_DROPOUT,
        optim={
            "name": "sgd",
            "lr": 1.0,
            "momentum": 0.0,
            "weight_decay": 0.0,
            "schedule": "constant",
            "warmup_steps": 0,
        },
        train={"grad_clip": clip, "steps": 1},
    )
    train(cfg, stream_factory=factory())
    torch.manual_seed(0)
    model = openalign.create_model("nano", **tiny_overrides(**NO_DROPOUT))
    after = weights(tmp_path / "run" / "final")
    delta = torch.sqrt(sum(((after[n] - p.detach()) ** 2).sum() for n, p in model.named_parameters()))
    assert delta == pytest.approx(clip, rel=1e-3)


def test_gradient_caching_in_the_loop_matches_plain_training(tmp_path: Path) -> None:
    virtual = {**NO_DROPOUT, "image": {"drop_connect_rate": 0.0, "batch_norm": "virtual", "virtual_batch_size": 4}}
    # [CLS] text features, whose rounding noise the tolerance below was measured on: nano's mean pooling moves
    # the stem weights of this chaotic net ~7x more under float32 reordering (still far below a wiring mistake).
    virtual["text"] = {**NO_DROPOUT["text"], "pooling": "cls"}
    # SGD, not LAMB: some biases have an exactly-zero true gradient (a batch norm downstream removes them), and
    # Adam-style normalisation would turn their float-rounding noise into full-size steps of random sign.
    # Few steps at a small lr: this tiny net on noise images is chaotic, and float-rounding differences
    # (the per-step gradients agree to ~1e-6, see test_train_grad_cache) grow tenfold per step at lr 0.1.
    sgd = {"name": "sgd", "lr": 0.01, "schedule": "constant", "warmup_steps": 0}
    plain = train(
        tiny_config(tmp_path / "plain", model=virtual, optim=sgd, train={"steps": 2}), stream_factory=factory()
    )
    cached = train(
        tiny_config(tmp_path / "cached", model=virtual, optim=sgd, train={"steps": 2, "chunk_size": 4}),
        stream_factory=factory(),
    )
    a, b = weights(plain.final_dir), weights(cached.final_dir)
    for k in a:
        # In float64 the two agree to 1e-9; float32 rounding, amplified by 4-sample batch norm, leaves ~4e-5
        # after two steps. A wiring mistake (a lost chunk, a doubled temperature gradient) moves weights by ~1e-2.
        torch.testing.assert_close(b[k], a[k], atol=2e-4, rtol=1e-3, msg=lambda m, k=k: f"{k}: {m}")


def test_bf16_autocast_runs_on_cpu_when_asked(tmp_path: Path) -> None:
    result = train(tiny_config(tmp_path / "run", train={"precision": "bf16", "steps": 2}), stream_factory=factory())
    assert result.step == 2 and result.skipped_steps == 0
    # Master weights stay fp32 under autocast.
    assert all(v.dtype in (torch.float32, torch.int64) for v in weights(result.final_dir).values())


def test_bf16_image_trains_the_image_tower_under_autocast_and_the_text_tower_in_fp32(tmp_path: Path) -> None:
    runs = {}
    for p in ("fp32", "bf16-image"):
        result = train(tiny_config(tmp_path / p, train={"precision": p, "steps": 2}), stream_factory=factory())
        assert result.precision == p
        runs[p] = weights(result.final_dir)
    fp32, mixed = runs["fp32"], runs["bf16-image"]
    assert all(v.dtype in (torch.float32, torch.int64) for v in mixed.values())
    # The first step's text-tower gradients depend on the image embeddings, so every weight moves a little
    # otherwise; a precision the loop ignored would leave them equal.
    conv = next(k for k in fp32 if k.startswith("image.") and k.endswith("weight") and fp32[k].dim() == 4)
    assert not torch.equal(mixed[conv], fp32[conv])
    torch.testing.assert_close(mixed[conv], fp32[conv], rtol=0, atol=2e-2)


def test_bf16_autocast_with_ghost_batch_norm_and_gradient_caching(tmp_path: Path) -> None:
    # pretrain_align_b7's combination on a GPU: ghost batch norm's group statistics arrive in bf16 and must
    # still update the fp32 running buffers (this raised on the first step before).
    virtual = {"image": {"batch_norm": "virtual", "virtual_batch_size": 4}}
    cfg = tiny_config(tmp_path / "run", model=virtual, train={"precision": "bf16", "steps": 2, "chunk_size": 8})
    result = train(cfg, stream_factory=factory())
    assert result.step == 2 and result.skipped_steps == 0
    state = weights(result.final_dir)
    means = [v for k, v in state.items() if k.endswith("running_mean")]
    assert means and all(m.dtype == torch.float32 and bool(m.isfinite().all()) for m in means)
    assert any(bool(m.abs().sum() > 0) for m in means)  # the statistics moved


def _transformers_align(path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(7)
    vision = transformers.AlignVisionConfig(width_coefficient=0.25, depth_coefficient=0.2, image_size=32)
    text = transformers.AlignTextConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    config = transformers.AlignConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=80, temperature_init_value=0.7
    )
    transformers.AlignModel(config).save_pretrained(path)


@pytest.mark.parametrize("kind", ["openalign", "transformers"])
def test_init_from_a_checkpoint_for_fine_tuning(tmp_path: Path, kind: str) -> None:
    src = tmp_path / "src"
    if kind == "openalign":
        torch.manual_seed(7)
        openalign.save_model(openalign.create_model("nano", **tiny_overrides()), src)
    else:
        _transformers_align(src)
    # The first step of the warm-up has lr 0: the run must end exactly where it started, at the source's weights.
    cfg = tiny_config(tmp_path / "run", train={"steps": 1})
    assert cfg.optim.warmup_steps > 0
    cfg.model.init = str(src)
    cfg.model.overrides = {}  # the architecture comes from the checkpoint
    result = train(cfg, stream_factory=factory())
    got = weights(result.final_dir)
    want = openalign.load_model(src).state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        if "running" in k or "num_batches" in k:
            continue  # one training forward updates batch-norm statistics
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=0, msg=k)


def test_time_based_checkpoints_and_atomic_leftovers(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # A write killed before its rename, and a directory that is not a complete checkpoint: both ignored.
    (run_dir / "checkpoints" / "step_0000099.tmp").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_0000099.tmp" / "trainer.pt").write_bytes(b"partial")
    (run_dir / "checkpoints" / "step_0000098").mkdir()
    assert list_checkpoints(run_dir) == []
    cfg = tiny_config(run_dir, train={"checkpoint_minutes": 1e-9, "keep_checkpoints": 2, "steps": 4})
    train(cfg, resume="latest", stream_factory=factory())
    # A clock that is always due checkpoints after every step; only the newest two are kept.
    assert [s for s, _ in list_checkpoints(run_dir)] == [3, 4]
    assert not (run_dir / "checkpoints" / "step_0000099.tmp").exists()


def test_resume_latest_without_checkpoints_starts_fresh(tmp_path: Path) -> None:
    result = train(tiny_config(tmp_path / "run", train={"steps": 1}), resume="latest", stream_factory=factory())
    assert result.step == 1


class FailingStream(MemoryStream):
    """A stream whose first batch fails, as a decoder or a shard reader can."""

    def __iter__(self):
        raise ValueError("the first batch could not be read")
        yield


def test_a_run_failing_before_its_first_step_leaves_only_what_was_there(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="first batch"):
        train(tiny_config(tmp_path / "new"), stream_factory=FailingStream)
    assert not (tmp_path / "new").exists()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "notes.txt").write_text("the user's")
    with pytest.raises(ValueError, match="first batch"):
        train(tiny_config(tmp_path / "old"), stream_factory=FailingStream)
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["notes.txt"]
    # A run that took a step keeps its record of it.
    train(tiny_config(tmp_path / "old", train={"steps": 1}), stream_factory=factory())
    assert (tmp_path / "old" / "config.yaml").is_file() and (tmp_path / "old" / "metrics.jsonl").is_file()


def test_resume_from_a_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a training checkpoint"):
        train(tiny_config(tmp_path / "run"), resume=str(tmp_path / "nope"), stream_factory=factory())


def test_karpathy_eval_set_is_capped_to_eval_images(tmp_path) -> None:
    from openalign.data.synthetic import write_retrieval_set
    from openalign.train.config import load_train_config
    from openalign.train.loop import _load_eval_set

    path = write_retrieval_set(tmp_path, 6, 5, seed=0, image_size=16)
    overrides = {"eval.source": "karpathy", "eval.karpathy": str(path), "eval.images": 3, "eval.every": 1}
    held = _load_eval_set(load_train_config("nano_cpu", overrides))
    assert len(held.images) == 3 and len(held.captions) == 15
    assert sorted(set(held.text_image_ids)) == [0, 1, 2]
    full = _load_eval_set(load_train_config("nano_cpu", {**overrides, "eval.images": 10}))
    assert len(full.images) == 6 and len(full.captions) == 30


def _all_saved_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every floating-point tensor a checkpoint directory holds, read straight from its files."""
    out = {f"model.{k}": v for k, v in weights(checkpoint).items()}
    trainer = torch.load(checkpoint / "trainer.pt", map_location="cpu", weights_only=True)

    def walk(tree: Any, prefix: str) -> None:
        if isinstance(tree, torch.Tensor):
            if tree.is_floating_point():
                out[prefix] = tree
        elif isinstance(tree, dict):
            for k, v in tree.items():
                walk(v, f"{prefix}.{k}")
        elif isinstance(tree, list | tuple):
            for i, v in enumerate(tree):
                walk(v, f"{prefix}.{i}")

    walk(trainer, "trainer")
    return out


@pytest.mark.parametrize("target", ["weights", "optimizer state"])
def test_a_non_finite_update_is_never_checkpointed(
    tmp_path: Path, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Step 3's update turns a tensor into NaN while its loss was finite (what an infinite lr does): the loop
    counts the step as good, but neither its checkpoint nor the one written when the run aborts is saved."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = 0

    def poison(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        nonlocal steps
        steps += 1
        if steps == 3:
            p = optimizer.param_groups[0]["params"][0]
            tensor = p if target == "weights" else optimizer.state[p]["exp_avg"]
            with torch.no_grad():
                tensor[(0,) * tensor.dim()] = float("nan")

    cfg = tiny_config(
        tmp_path / "run",
        optim={"warmup_steps": 1, "total_steps": 10},
        train={"checkpoint_every": 1, "keep_checkpoints": 0, "max_bad_steps": 2},
    )
    handle = register_optimizer_step_post_hook(poison)
    try:
        with pytest.raises(NonFiniteError, match=r"the state after step [34] is not finite either"):
            train(cfg, stream_factory=factory())
    finally:
        handle.remove()
    err = capsys.readouterr().err
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [1, 2]
    for _, path in list_checkpoints(tmp_path / "run"):
        tensors = _all_saved_tensors(path)
        assert any(k.startswith("trainer.optimizer.state.") for k in tensors)
        assert all(torch.isfinite(v).all() for v in tensors.values()), path
    assert "checkpoint not written, the previous ones are kept" in err and "hold NaN or Inf" in err
    assert not (tmp_path / "run" / "final").exists()
    assert not list((tmp_path / "run" / "checkpoints").glob("*.tmp"))


def test_final_is_replaced_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from openalign.train import checkpoint

    run_dir = tmp_path / "run"
    real_save = checkpoint.save_file

    def save_file(tensors: dict[str, torch.Tensor], filename: str, **kw: Any) -> None:
        if Path(filename).parent.name.startswith("final"):
            # Killed while writing: part of the file is on disk, then the process is gone.
            Path(filename).write_bytes(b"partial")
            raise OSError("no space left on device")
        real_save(tensors, filename, **kw)

    monkeypatch.setattr(checkpoint, "save_file", save_file)
    with pytest.raises(OSError, match="no space left"):
        train(tiny_config(run_dir, train={"steps": 1}), stream_factory=factory())
    assert sorted(p.name for p in run_dir.iterdir() if "final" in p.name) == []

    monkeypatch.setattr(checkpoint, "save_file", real_save)
    first = train(tiny_config(run_dir, train={"steps": 1}), stream_factory=factory())
    before = weights(first.final_dir)
    monkeypatch.setattr(checkpoint, "save_file", save_file)
    with pytest.raises(OSError, match="no space left"):
        train(tiny_config(run_dir, train={"steps": 2}), resume="latest", stream_factory=factory())
    # The old final model is still whole, and nothing half-written sits beside it.
    assert sorted(p.name for p in run_dir.iterdir() if "final" in p.name) == ["final"]
    after = openalign.load_model(run_dir / "final").state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())

    # A leftover of a write killed outright (no chance to clean up) is cleared by the next one.
    monkeypatch.setattr(checkpoint, "save_file", real_save)
    (run_dir / "final.tmp").mkdir()
    (run_dir / "final.tmp" / "model.safetensors").write_bytes(b"partial")
    second = train(tiny_config(run_dir, train={"steps": 2}), resume="latest", stream_factory=factory())
    assert sorted(p.name for p in run_dir.iterdir() if "final" in p.name) == ["final"]
    assert not torch.equal(weights(second.final_dir)["text_proj.weight"], before["text_proj.weight"])


@pytest.mark.parametrize(
    ("source", "pairs", "warning"),
    [("shards", 3, "each pair appears ~2.7 times per batch"), ("synthetic", 4, "~2.0 times"), ("synthetic", 8, None)],
)
def test_a_batch_larger_than_the_data_warns_once(
    tmp_path: Path, source: str, pairs: int, warning: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real stream: shard epochs are measured as they are read, a finite synthetic world has its size."""
    from openalign.text import train_wordpiece
    from test_train_data import caption, write_dataset

    tokenizer = train_wordpiece([caption(i) for i in range(50)] * 2, vocab_size=120, min_frequency=1)
    if source == "shards":
        data = {"source": "shards", "shards": write_dataset(tmp_path / "shards", pairs, pairs)}
    else:
        data = {"source": "synthetic", "synthetic": {"size": pairs, "image_size": 16}}
    cfg = tiny_config(
        tmp_path / "run",
        model={"text": {"vocab_size": 128}},
        data={**data, "workers": 0, "max_text_length": 12},
        train={"steps": 3},
        log={"progress": False},
    )
    train(cfg, stream_factory=None, tokenizer=tokenizer)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    if warning is None:
        assert warnings == []
        return
    assert len(warnings) == 1
    assert f"the global batch of 8 is larger than the {pairs} pairs of an epoch" in warnings[0]
    assert warning in warnings[0] and "in-batch negatives include copies of the positive" in warnings[0]


@pytest.mark.parametrize(("record", "resampled"), [("stats", True), ("stats", False), ("parquet", True)])
def test_shards_recording_fewer_samples_than_the_batch_warn_before_step_one(
    tmp_path: Path, record: str, resampled: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """Shards written by ``openalign shard`` record their sample counts: a batch larger than their sum is
    named before the first step, even when no epoch is ever measured (resampled draws), and only once."""
    from openalign.data.shards import write_shards
    from openalign.text import train_wordpiece
    from test_train_data import caption, encoded, picture

    tokenizer = train_wordpiece([caption(i) for i in range(50)] * 2, vocab_size=120, min_frequency=1)
    samples = [{"key": f"{i:06d}", "jpg": encoded(picture(i)), "txt": caption(i)} for i in range(5)]
    shards = write_shards(samples, tmp_path / "shards", samples_per_shard=3)
    if record == "parquet":
        for stats in (tmp_path / "shards").glob("*_stats.json"):
            stats.unlink()
    cfg = tiny_config(
        tmp_path / "run",
        model={"text": {"vocab_size": 128}},
        data={
            "source": "shards",
            "shards": [str(p) for p in shards],
            "workers": 0,
            "max_text_length": 12,
            "batch_size": 16,
            "resampled": resampled,
        },
        train={"steps": 1},
        log={"progress": False, "every": 1},
    )
    train(cfg, stream_factory=None, tokenizer=tokenizer)
    err = capsys.readouterr().err.splitlines()
    warnings = [line for line in err if line.startswith("warning:")]
    assert warnings == [
        "warning: the global batch of 16 is larger than the 5 samples the shards record: each pair appears "
        "~3.2 times per batch, so in-batch negatives include copies of the positive; lower train.batch_size "
        "or train on more pairs"
    ]


def test_on_an_accelerator_the_loop_checks_and_cuts_captions_on_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text_widths: list[int]
) -> None:
    """Where reading a tensor's values waits for all queued work (a GPU's), the loop checks each batch's token ids
    and measures each chunk's captions while the batch is still on the host, and the model reads nothing. Without a
    GPU here, the accelerator is declared; the losses are those of the CPU's own path (the model trimming captions
    itself, short ones apart), up to rounding."""
    options = {"steps": 3, "chunk_size": 4}
    plain = train(tiny_config(tmp_path / "cpu", train=options), stream_factory=factory())
    text_widths.clear()
    checked = declare_accelerator(monkeypatch)
    cut = train(tiny_config(tmp_path / "cut", train=options), stream_factory=factory())
    assert cut.step == plain.step == 3
    assert checked == [12, 12, 12]  # once a step, by the loop, on the batch as it arrives: none by the model
    # Each chunk's captions at their longest (3 to 11 tokens in 12 columns), twice a step with gradient caching.
    assert len(text_widths) == 3 * 2 * 2 and max(text_widths) < 12 and len(set(text_widths)) > 1
    want = [json.loads(line).get("loss") for line in (tmp_path / "cpu" / "metrics.jsonl").read_text().splitlines()]
    got = [json.loads(line).get("loss") for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert got == pytest.approx(want, rel=1e-5)


def test_the_logged_rate_leaves_out_evaluations_and_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pairs/s is training's rate: a slow evaluation or checkpoint between steps must not lower it."""
    from openalign.train import loop

    pause = 0.5

    def spin() -> None:
        # Busy, not asleep: a core left idle can come back slower, which would be charged to the steps after.
        end = time.perf_counter() + pause
        while time.perf_counter() < end:
            pass

    save = loop._Run.save
    monkeypatch.setattr(loop._Run, "save", lambda self: (spin(), save(self))[1])
    monkeypatch.setattr(loop._Run, "_evaluate", lambda self: spin())  # its set needs a tokenizer; the time is the point
    cfg = tiny_config(tmp_path, log={"every": 2}, train={"checkpoint_every": 2}, eval={"every": 2})
    start = time.perf_counter()
    train(cfg, stream_factory=factory())
    elapsed = time.perf_counter() - start
    rates = [r["pairs_per_s"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())]
    # Counted in, a window after the first would hold two pauses (1 s) for its 16 pairs: under 16 pairs/s.
    assert len(rates) == 3 and elapsed > 5 * pause
    assert min(rates[1:]) > 2 * 16, rates


class SlowStream:
    """A stream whose every batch costs ``delay`` seconds of busy work before it is handed over: workers that do
    not keep up."""

    def __init__(self, stream: MemoryStream, delay: float) -> None:
        self.stream, self.delay = stream, delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    def __iter__(self) -> Any:
        for batch in self.stream:
            end = time.perf_counter() + self.delay
            while time.perf_counter() < end:  # busy, as in the test above
                pass
            yield batch


def test_the_log_says_what_share_of_training_waited_for_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``data_wait``: the share of each window's training time the loop spent waiting for its next batch; the
    run's last line gives it for the whole run. Starved, it approaches 1; fed from memory, it stays near 0."""
    windows, shares, lines, bars = {}, {}, {}, {}
    for delay in (0.0, 0.4):
        make = factory()
        cfg = tiny_config(tmp_path / str(delay), log={"every": 2})
        train(cfg, stream_factory=lambda *a, make=make, delay=delay, **k: SlowStream(make(*a, **k), delay))
        records = [json.loads(line) for line in (tmp_path / str(delay) / "metrics.jsonl").read_text().splitlines()]
        windows[delay] = [r for r in records if "pairs_per_s" in r]
        shares[delay] = [r["data_wait"] for r in windows[delay]]
        err = capsys.readouterr().err
        # A line of its own, above the progress bar (printed plainly, it ran on from the bar's last state).
        (lines[delay],) = [line for line in err.splitlines() if line.startswith("finished")]
        bars[delay] = err
    assert len(shares[0.4]) == len(shares[0.0]) == 3
    # Starved: each step waited at least its batch's 0.4 s, whatever else the cores were doing. The share times
    # the window's seconds a step (its batch of 8 over pairs_per_s) gives back the wait a step.
    for record in windows[0.4]:
        assert record["data_wait"] * 8 / record["pairs_per_s"] >= 0.4 and record["data_wait"] <= 1.0, record
    # Fed from memory: a step's own work dominates.
    assert max(shares[0.0]) < 0.5 and min(shares[0.0]) >= 0.0, shares
    assert min(shares[0.4]) > max(shares[0.0]), shares
    run_share = float(lines[0.4].rsplit("waited for data ", 1)[1].split("%")[0]) / 100
    assert min(shares[0.4]) - 0.01 <= run_share <= max(shares[0.4]) + 0.01, (lines[0.4], shares)
    assert lines[0.0].startswith("finished 6 steps;") and "of the training time" in lines[0.0]
    assert f", data={shares[0.4][-1]:.0%}," in bars[0.4]  # the progress bar shows the last window's share


TORCH_OOM = (
    "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.02 GiB is "
    "free. Of the allocated memory 75.10 GiB is allocated by PyTorch, and 1.50 GiB is reserved but unallocated."
)


def test_running_out_of_device_memory_is_one_line_saying_what_to_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from openalign.train import loop
    from openalign.train import step as train_step

    step = train_step.TrainStep.embed_and_backward
    calls: list[int] = []

    def third_fails(self: Any, *args: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError(TORCH_OOM)
        return step(self, *args)

    monkeypatch.setattr(train_step.TrainStep, "embed_and_backward", third_fails)
    with pytest.raises(loop.OutOfMemoryError) as err:
        train(tiny_config(tmp_path, train={"checkpoint_every": 2}), stream_factory=factory())
    assert str(err.value) == (
        "out of cpu memory in step 3 (allocating 20.00 GiB): set train.chunk_size (gradient caching: the same "
        "batch, that many pairs at a time) or set train.grad_checkpointing true; `openalign plan --config CONFIG "
        "--device GPU` names a chunk size that fits; the checkpoint of step 2 is kept (--resume latest)"
    )
    assert err.value.__cause__ is None and err.value.__suppress_context__  # not PyTorch's paragraph again

    # On a GPU the line has its peak and capacity; with chunks and checkpointing on, only a smaller chunk is left.
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 75.1 * 1024**3)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d=None: type("P", (), {"total_memory": 79.19 * 1024**3})
    )
    cfg = tiny_config(tmp_path / "chunked", train={"chunk_size": 64, "grad_checkpointing": True})
    assert loop._out_of_memory(cfg, torch.device("cuda", 0), 1, torch.OutOfMemoryError(TORCH_OOM)) == (
        "out of GPU memory in step 1 (allocating 20.00 GiB); peak 75.1 GiB of 79.2: lower train.chunk_size (now 64); "
        "`openalign plan --config CONFIG --device GPU` names a chunk size that fits"
    )


def test_a_model_too_large_for_the_device_is_one_line_naming_fsdp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from openalign.cli import main
    from openalign.train import loop

    def too_large(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError(TORCH_OOM)

    monkeypatch.setattr(openalign.DualEncoder, "to", too_large)
    with pytest.raises(
        loop.OutOfMemoryError,
        match=r"^out of cpu memory while the model was set up \(allocating "
        r"20\.00 GiB\): the model does not fit one device: train\.strategy fsdp shards it",
    ):
        train(tiny_config(tmp_path), stream_factory=factory())
    # The command: that line, status 3 (as a run stopped by non-finite steps), no traceback.
    monkeypatch.setattr(loop, "train", lambda cfg, resume=None: (_ for _ in ()).throw(loop.OutOfMemoryError("why")))
    assert main(["train", "--config", "nano_cpu", "--train.run_dir", str(tmp_path / "cli")]) == 3
    assert capsys.readouterr().err.splitlines()[-1] == "openalign train: error: why"


def test_the_run_says_where_and_how_it_computes_before_its_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from types import SimpleNamespace

    from openalign.train import loop

    train(tiny_config(tmp_path, optim={"total_steps": 2}), stream_factory=factory())
    err = capsys.readouterr().err
    assert err.startswith("training 2 steps of 8 pairs on the CPU (1 thread): fp32, eager\n")
    train(tiny_config(tmp_path, optim={"total_steps": 3}), resume="latest", stream_factory=factory())
    assert "training steps 3-3 of 8 pairs on the CPU (1 thread): fp32, eager\n" in capsys.readouterr().err

    # Eight GPUs under torchrun, and one.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    cfg = tiny_config(tmp_path, train={"chunk_size": 64, "strategy": "fsdp"}, optim={"total_steps": 10})
    run = SimpleNamespace(cfg=cfg, step=0, total_steps=10, global_batch=16384, precision="bf16", compiled=False)
    run.info = SimpleNamespace(device=torch.device("cuda", 3), world_size=8)
    assert (
        loop._Run.summary(run) == "training 10 steps of 16384 pairs on 8 x NVIDIA H200: bf16, eager, fsdp, chunks of 64"
    )
    run.info, run.compiled = SimpleNamespace(device=torch.device("cuda", 0), world_size=1), True
    assert (
        loop._Run.summary(run)
        == "training 10 steps of 16384 pairs on NVIDIA H200 (cuda:0): bf16, compiled, chunks of 64"
    )
