"""Compiled training: on by default on CUDA only, one graph per tower and grad mode, no recompilation across
caption lengths, grad modes and steps, the same losses and weights as eager, with activation checkpointing and
under DDP too; FSDP2 across processes trains eager."""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters, guard_failures

from conftest import declare_accelerator, tiny_overrides
from dist_utils import run_gloo
from openalign.config import ConfigError
from openalign.model.dual_encoder import DualEncoder
from openalign.train import towers
from openalign.train.config import check_compile, compile_enabled, load_train_config
from openalign.train.grad_cache import chunk_batch
from openalign.train.loop import train
from openalign.train.plan import fake_world
from openalign.train.towers import caption_widths
from test_train_loop import MemoryStream, factory, tiny_config, weights
from test_train_resume import LAMB, ddp_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_compile_is_on_by_default_on_cuda_only() -> None:
    auto = load_train_config({"data": {"source": "synthetic"}})
    assert auto.train.compile is None
    assert not compile_enabled(auto, "cpu") and not compile_enabled(auto, torch.device("cpu"))
    assert compile_enabled(auto, "cuda") and compile_enabled(auto, "cuda:1")
    assert compile_enabled(auto, torch.device("cuda", 1))  # a device object needs no GPU
    # A setting wins over the device; YAML's true/false as before, null is the default.
    for value in (True, False):
        cfg = load_train_config({"data": {"source": "synthetic"}, "train": {"compile": value}})
        assert compile_enabled(cfg, "cpu") is value and compile_enabled(cfg, "cuda") is value
    assert load_train_config("nano_cpu", {"train.compile": None}).train.compile is None
    # FSDP2 across processes runs eager by default and refuses to compile (its hooks break the towers' one graph);
    # DDP compiles, and so does a single process whatever its strategy.
    fsdp = load_train_config({"data": {"source": "synthetic"}, "train": {"strategy": "fsdp"}})
    assert not compile_enabled(fsdp, "cuda", world_size=2) and compile_enabled(fsdp, "cuda", world_size=1)
    assert compile_enabled(auto, "cuda", world_size=8)
    check_compile(fsdp, 2)  # unset: nothing to refuse
    forced = load_train_config({"data": {"source": "synthetic"}, "train": {"strategy": "fsdp", "compile": True}})
    check_compile(forced, 1)
    with pytest.raises(ConfigError, match=r"train\.strategy fsdp"):
        check_compile(forced, 2)


@pytest.mark.parametrize(
    ("triton", "capability", "reason"),
    [
        (True, (9, 0), None),
        (True, (7, 0), None),
        (True, (6, 0), "Triton compiles for GPUs of compute capability 7.0 and later, and this one's is 6.0"),
        (False, (9, 0), "compiling for a GPU needs the triton package, which is not installed"),
    ],
)
def test_a_gpu_inductor_cannot_compile_for_trains_eager_by_default_and_refuses_compile_true(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    triton: bool,
    capability: tuple[int, int],
    reason: str | None,
) -> None:
    """Inductor writes a GPU's kernels in Triton: a P100 (compute capability 6.0), or a PyTorch without the triton
    package, failed at the first compiled call; such a GPU trains eager unless asked, and refuses when asked."""
    import torch.utils._triton

    from openalign.train.config import gpu_compile_blocker

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    monkeypatch.setattr(torch.utils._triton, "has_triton_package", lambda: triton)
    auto = load_train_config({"data": {"source": "synthetic"}})
    forced = load_train_config({"data": {"source": "synthetic"}, "train": {"compile": True}})
    assert gpu_compile_blocker(torch.device("cuda", 0)) == reason == gpu_compile_blocker("cuda:0")
    assert compile_enabled(auto, "cuda:0") is (reason is None)
    assert compile_enabled(auto, "cuda:0", gpu_compiles=True)  # a plan's named GPU, whatever this machine holds
    assert gpu_compile_blocker("cpu") is None and not compile_enabled(auto, "cpu")
    if reason is None:
        check_compile(forced, 1, "cuda:0")
    else:
        with pytest.raises(ConfigError) as err:
            check_compile(forced, 1, "cuda:0")
        assert str(err.value) == f"train.compile true: {reason}; set train.compile false (or leave it unset)"
    check_compile(forced, 1, "cpu")  # compiling for the CPU needs no Triton

    # The loop says so once, at the start (here on the CPU, given the GPU's answer).
    import openalign.train.loop as loop

    monkeypatch.setattr(loop, "gpu_compile_blocker", lambda device: reason)
    train(tiny_config(tmp_path, optim={"total_steps": 1}), stream_factory=factory())
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train.compile")]
    assert said == ([] if reason is None else [f"train.compile: eager, as {reason}"])


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row["loss"] for row in map(json.loads, lines) if "loss" in row]


def test_compiled_cached_training_compiles_once_and_never_again_and_matches_eager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fresh_dynamo: Any
) -> None:
    # Dynamo's "eager" backend: graph capture, guards and recompilation are Dynamo's whatever the backend, and
    # this one skips minutes of C++ builds (inductor's graphs of these towers: tests/test_compile.py, slow).
    monkeypatch.setattr(towers, "compile_towers", partial(towers.compile_towers, backend="eager"))
    # Captions of 3 to 11 tokens in 12 columns: eager trims each batch (and chunk) to its longest; gradient
    # caching in chunks of 4 runs every tower twice a step, without and with a graph. Dropout and stochastic
    # depth stay on: both passes must draw the same masks, compiled or not.
    # Plain SGD: Adam-like steps move a weight whose gradient is rounding noise by a whole lr either way.
    sgd = {"name": "sgd", "lr": 0.01, "schedule": "constant", "warmup_steps": 0}
    options = {"steps": 3, "chunk_size": 4}
    # Eager on a CPU encodes short captions apart from long ones (``length_buckets``), the compiled tower each
    # chunk whole at its width: the same values, but attention's sums over a caption's keys then run over fewer
    # masked columns, which a CPU's vectorised kernels may add in another order (on an AVX2 CPU the second step's
    # loss differed in its 7th digit). Without buckets the arithmetic is the same, which is what the comparison
    # below is for.
    monkeypatch.setattr(towers, "length_buckets", lambda mask: None)
    eager = train(
        tiny_config(tmp_path / "eager", optim=sgd, train={**options, "compile": False}), stream_factory=factory()
    )
    assert "compiled towers" not in capsys.readouterr().err
    assert not counters["stats"]

    widths: list[int] = []
    call = towers._CompiledText.__call__

    def recorded(self: Any, ids: torch.Tensor, mask: Any = None, buckets: Any = None) -> torch.Tensor:
        widths.append(ids.shape[1])
        return call(self, ids, mask, buckets)

    monkeypatch.setattr(towers._CompiledText, "__call__", recorded)
    compiled = train(
        tiny_config(tmp_path / "compiled", optim=sgd, train={**options, "compile": True}), stream_factory=factory()
    )
    err = capsys.readouterr().err
    assert err.count("compiled towers in ") == 1  # reported once, at the first step
    assert err.index("compiling the towers (once, in the first step) ...") < err.index("compiled towers in ")
    # The compiling step is left out of the logged rate, which would otherwise count compilation as training.
    records = [json.loads(line) for line in (tmp_path / "compiled" / "metrics.jsonl").read_text().splitlines()]
    assert [("pairs_per_s" in r) for r in records] == [False, True, True]

    assert not counters["graph_break"]  # fullgraph=True would have raised on one anyway
    # One graph per tower and grad mode (gradient caching's no-graph pass and its graph pass), each compiled once:
    # no caption width, chunk, step or switch of grad mode compiled anything again.
    assert counters["stats"]["unique_graphs"] == 4
    assert not guard_failures, {code.co_name: reasons for code, reasons in guard_failures.items()}
    # The text tower took each chunk cut to its longest caption, on the host: several widths, none the padded 12.
    assert len(widths) == 3 * 2 * 2 and len(set(widths)) > 1 and max(widths) < 12

    # Compiled or not, the same arithmetic: eager's text tower reads each chunk cut to its longest caption, the
    # compiled one too (cut on the host), and Dynamo's eager backend runs the same kernels.
    assert _losses(tmp_path / "compiled") == _losses(tmp_path / "eager")
    assert compiled.step == eager.step == 3
    assert eager.final_dir is not None and compiled.final_dir is not None
    want, got = weights(eager.final_dir), weights(compiled.final_dir)
    assert want.keys() == got.keys()
    # Weights and batch-norm statistics after three updates: within 2e-4 (the largest difference seen is 1e-4, in
    # running variances near 1). The bound is absolute: tensors that sit at rounding noise (a bias ahead of a
    # batch norm, whose true gradient is zero) differ by their whole size.
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-3, atol=2e-4, msg=name)


def _nano_compiled_by_dynamo() -> tuple[DualEncoder, int]:
    """A tiny nano model in training mode, its towers compiled with Dynamo's eager backend (its guards are
    Dynamo's whatever the backend), and its captions' padded width."""
    torch.manual_seed(0)
    cfg = load_train_config({"data": {"source": "synthetic"}, "model": {"preset": "nano", **tiny_overrides()}})
    model = DualEncoder(cfg.model.resolve()).train()
    towers.compile_towers(model, backend="eager")
    return model, model.config.text.max_length


def test_a_caption_batch_at_its_full_width_after_cut_ones_compiles_nothing_again(fresh_dynamo: Any) -> None:
    """Cut below their padded width, captions are views a padded row apart; a batch whose longest caption fills
    every column (alt-text truncated at ``max_length``) is not cut, and Dynamo guarded on the difference: its
    graph was compiled a second time, minutes on a GPU, in the middle of a run."""
    model, columns = _nano_compiled_by_dynamo()
    widths = []
    for longest in (columns, 5, 9, columns, 3):  # full, cut, cut, full, cut
        mask = torch.zeros(4, columns, dtype=torch.long)
        for row, n in enumerate((2, 3, longest, 2)):
            mask[row, :n] = 1
        batch = {"input_ids": torch.randint(5, 101, (4, columns)) * mask, "attention_mask": mask}
        (cut,) = chunk_batch(batch, 4, caption_widths(batch))
        widths.append(cut["input_ids"].shape[1])
        model.text_features(cut["input_ids"], cut["attention_mask"]).sum().backward()
    assert widths == [columns, 5, 9, columns, 3]
    assert counters["stats"]["unique_graphs"] == 1  # the text tower with a graph, compiled once
    assert not guard_failures, {code.co_name: reasons for code, reasons in guard_failures.items()}


def test_captions_anywhere_in_their_storage_compile_nothing_again(fresh_dynamo: Any) -> None:
    """The stream's captions share one storage, the mask after the token ids. An uncut batch was passed where it
    lay, a cut one copied to the start of a storage of its own, and Dynamo guarded on the mask's storage offset
    (2 or more, against 0): on a CPU, the first cut batch after an uncut one compiled the graph a second time,
    mid-run. A gradient-cached step's later chunks start rows into their storage too."""
    model, columns = _nano_compiled_by_dynamo()
    handed = []
    for longest in (columns, 5, columns, 9):  # uncut, cut, uncut, cut
        captions = torch.zeros(2, 4, columns, dtype=torch.long)  # ids, then mask: one storage
        for row, n in enumerate((longest, 3, 2, longest)):
            captions[1, row, :n] = 1
        captions[0] = torch.randint(5, 101, (4, columns)) * captions[1]
        batch = {"input_ids": captions[0], "attention_mask": captions[1]}
        for chunk in chunk_batch(batch, 2, caption_widths(batch, 2)):  # the second chunk two rows in
            mask = chunk["attention_mask"]
            handed.append((mask.shape[1], mask.storage_offset()))
            model.text_features(chunk["input_ids"], mask).sum().backward()
    rows = [4 * columns, 6 * columns]  # the two chunks' masks, where they lie
    assert handed == [(w, at) for w in (columns, 5, columns, 9) for at in rows]
    assert counters["stats"]["unique_graphs"] == 1
    assert not guard_failures, {code.co_name: reasons for code, reasons in guard_failures.items()}


def test_compiled_towers_with_activation_checkpointing_train_as_eager_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_dynamo: Any
) -> None:
    # pretrain_align's recipe checkpoints its blocks. Eager checkpointing counts each block's calls to keep batch
    # norm from folding the recomputed forward into its running statistics again; Dynamo refused that counter (a
    # side effect inside a checkpoint), so a compiled run with checkpointing failed at its first step. A compiled
    # graph recomputes from its functional form and updates the statistics once. AOTAutograd's eager backend
    # ("aot_eager"): the functional graph inductor compiles, without its code generation.
    monkeypatch.setattr(towers, "compile_towers", partial(towers.compile_towers, backend="aot_eager"))
    sgd = {"name": "sgd", "lr": 0.01, "schedule": "constant", "warmup_steps": 0}
    options = {"steps": 2, "chunk_size": 4, "grad_checkpointing": True}
    runs = [
        train(tiny_config(tmp_path / str(c), optim=sgd, train={**options, "compile": c}), stream_factory=factory())
        for c in (False, True)
    ]
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 4  # each tower with and without a graph, as without checkpointing
    assert runs[0].final_dir is not None and runs[1].final_dir is not None
    want, got = weights(runs[0].final_dir), weights(runs[1].final_dir)
    # Running statistics included: folded in once per forward, as eager code does (twice would move them by a
    # whole momentum step); dropout and stochastic depth draw the same masks in the recomputed forward.
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-3, atol=2e-4, msg=name)


def test_evaluation_runs_compiled_towers_eager_and_trims_captions(fresh_dynamo: Any) -> None:
    torch.manual_seed(0)
    cfg = load_train_config({"data": {"source": "synthetic"}, "model": {"preset": "nano", **tiny_overrides()}})
    model = DualEncoder(cfg.model.resolve())
    towers.compile_towers(model, backend="eager")
    model.eval()
    ids = torch.randint(5, 101, (3, 12))
    mask = torch.ones_like(ids)
    mask[:, 6:] = 0
    trimmed: list[int] = []
    hook = model.text.register_forward_pre_hook(lambda _, args: trimmed.append(args[0].shape[1]))
    with torch.no_grad(), towers.eager_towers():
        model.encode_image(torch.randn(3, 3, 32, 32))
        model.encode_text(ids, mask)
    hook.remove()
    assert trimmed == [6]
    assert not counters["stats"]  # nothing compiled


def test_the_whole_model_compiles_to_one_graph_that_reads_no_values(fresh_dynamo: Any) -> None:
    """``torch.compile(model)``, as a user or ``bench model --compile`` calls it (transformers' AlignModel makes
    one graph): one graph, no break. Eager code reads the captions' width and checks the token ids on the host; a
    compiled graph cannot read values (each read would break the graph and, on a GPU, wait for all queued work),
    so it keeps the padded width and the eager outputs up to rounding, and new caption lengths compile nothing."""
    torch.manual_seed(0)
    cfg = load_train_config({"data": {"source": "synthetic"}, "model": {"preset": "nano", **tiny_overrides()}})
    model = DualEncoder(cfg.model.resolve())
    compiled = torch.compile(model, backend="eager")

    def batch(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mask = (torch.arange(12) < torch.tensor(lengths)[:, None]).long()
        return torch.randn(len(lengths), 3, 32, 32), torch.randint(5, 101, (len(lengths), 12)) * mask, mask

    seen: list[tuple[int, int]] = []
    for lengths in ([3, 7, 5, 4], [2, 11, 6, 9]):  # trimmed to 7, then 11 columns in eager code
        pixels, ids, mask = batch(lengths)
        model.train()
        image, text = compiled(pixels, ids, mask)
        (image.sum() + text.sum()).backward()
        model.eval()
        with torch.no_grad():
            got, want = compiled(pixels, ids, mask), model(pixels, ids, mask)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
        seen.append((counters["stats"]["unique_graphs"], sum(map(len, guard_failures.values()))))
    assert not counters["graph_break"], dict(counters["graph_break"])
    # One graph per grad and train mode (training's with a graph, then evaluation's without: the guard on grad mode
    # fails once, which is how the second is made); the second batch's lengths compiled nothing again.
    assert seen == [(2, 1), (2, 1)]


def test_compiled_towers_read_no_token_on_an_accelerator_and_training_checks_them_on_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_dynamo: Any
) -> None:
    """Training measures the captions on the host, so an accelerator's forward has nothing to read but the ids'
    validity, and each read would make the host wait for all queued work. Without a GPU here, the accelerator is
    declared (tensors the host cannot read for free): the forward reads no value, eager or compiled, and training
    checks each batch's ids on the host before it moves, so a bad id still stops the run with the model's error."""
    from test_model import _HostReads

    monkeypatch.setattr(towers, "compile_towers", partial(towers.compile_towers, backend="eager"))
    torch.manual_seed(0)
    cfg = load_train_config({"data": {"source": "synthetic"}, "model": {"preset": "nano", **tiny_overrides()}})
    model = DualEncoder(cfg.model.resolve())
    ids = torch.randint(5, 101, (4, 12))
    mask = (torch.arange(12) < torch.tensor([3, 7, 5, 4])[:, None]).long()
    pixels = torch.randn(4, 3, 32, 32)
    declare_accelerator(monkeypatch)
    tolists: list[torch.Tensor] = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: tolists.append(t) or real_tolist(t))

    def reads() -> int:
        """Values read by the host: ``.tolist()`` and every scalar read (``int()``, ``bool()``, ``.item()``)."""
        tolists.clear()
        # Dynamo's graphs run eager here so that the counting mode sees every op; the captions stay as handed over.
        with torch.compiler.set_stance("force_eager"), _HostReads() as counter:
            model(pixels, ids, mask)
        return counter.reads + len(tolists)

    assert reads() == 0
    towers.compile_towers(model)
    assert reads() == 0

    class BadIds(MemoryStream):
        def __iter__(self) -> Any:
            for batch in super().__iter__():
                batch["input_ids"][0, 1] = 500  # beyond the tiny vocabulary of 101
                yield batch

    with pytest.raises(ValueError, match="token id 500 is outside the model's vocabulary"):
        train(tiny_config(tmp_path / "bad", train={"steps": 1, "compile": True}), stream_factory=BadIds)


def _compiled_run(rank: int, world: int, run_dir: str) -> None:
    # Dynamo's eager backend, as above: graph capture is Dynamo's whatever the backend.
    towers.compile_towers = partial(towers.compile_towers, backend="eager")  # type: ignore[assignment]
    config = ddp_config(run_dir, steps=2, optim=LAMB, group=4, chunk=4)
    train(
        dataclasses.replace(config, train=dataclasses.replace(config.train, compile=True)),
        stream_factory=factory(blocked=True),
    )


def test_compiled_towers_train_under_ddp_as_one_process_does(tmp_path: Path) -> None:
    """Two gloo ranks, each with its half of the batch and gradient caching in chunks of 4, the towers compiled one
    graph each inside DDP: the weights of one process training the whole batch eager."""
    (tmp_path / "ddp").mkdir()
    run_gloo(_compiled_run, 2, tmp_path / "ddp", str(tmp_path / "compiled"))
    single = train(ddp_config(tmp_path / "single", steps=2, optim=LAMB, group=4), stream_factory=factory(blocked=True))
    assert single.final_dir is not None
    want, got = weights(single.final_dir), weights(tmp_path / "compiled" / "final")
    assert want.keys() == got.keys()
    for name in (k for k in want if "running" not in k and "num_batches" not in k):
        torch.testing.assert_close(got[name], want[name], atol=3e-5, rtol=1e-4, msg=name)


def test_fsdp_across_ranks_refuses_compiled_towers_before_any_step(tmp_path: Path) -> None:
    """FSDP2 across ranks asked to compile says why it cannot, in one line, before any step: ``train`` as rank 0
    of two (a process group whose collectives move no data; the refusal reads only the world's size)."""
    config = ddp_config(tmp_path / "sharded", strategy="fsdp", steps=2, optim=LAMB, group=4, chunk=4)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, compile=True))
    with fake_world(2), pytest.raises(ConfigError, match=r"does not combine with train\.strategy fsdp"):
        train(config, stream_factory=factory(blocked=True))


def test_a_compile_mode_reaches_both_towers_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench model --compile-mode``: the mode goes to every ``torch.compile`` of the towers; the default adds
    nothing, so a backend without modes (the tests' eager one) still takes the towers."""
    calls: list[dict[str, Any]] = []

    def record(fn: Any, **options: Any) -> Any:
        calls.append(options)
        return fn

    monkeypatch.setattr(torch, "compile", record)
    cfg = load_train_config({"data": {"source": "synthetic"}, "model": {"preset": "nano", **tiny_overrides()}})
    model = DualEncoder(cfg.model.resolve())
    towers.Towers(model, device=torch.device("cpu"), compiled=True, mode="reduce-overhead")
    assert calls == [{"fullgraph": True, "mode": "reduce-overhead"}] * 4  # two towers, two grad modes
    calls.clear()
    model = DualEncoder(cfg.model.resolve())
    assert not towers.Towers(model, device=torch.device("cpu"), compiled=True).buckets
    assert calls == [{"fullgraph": True}] * 4
