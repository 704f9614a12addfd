"""The command line as a whole: every --help, the one override mechanism, fast start, README lines."""

from __future__ import annotations

import dataclasses
import importlib
import shlex
import subprocess
import sys
import time
import typing
from pathlib import Path
from unittest import mock

import pytest

from openalign.cli import build_parser, main, schema
from openalign.cli.options import Parser
from readme_utils import readme_lines


def _commands(parser: Parser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path: ("filter",), ("index", "build"), ("bench", "model"), ..."""
    parser.ensure_built()
    out = []
    for action in parser._actions:
        if isinstance(action, __import__("argparse")._SubParsersAction):
            for name, sub in action.choices.items():
                out.append((*prefix, name))
                out += _commands(sub, (*prefix, name))
    return out


COMMANDS = _commands(build_parser())


def test_every_documented_command_is_there() -> None:
    names = {c[0] for c in COMMANDS}
    expected = "filter dedup copy-detector vocab shard train eval index search serve convert bench demo experiments"
    assert set(expected.split()) | {"plot"} <= names
    assert ("index", "build") in COMMANDS and ("bench", "retrieval") in COMMANDS
    assert ("copy-detector", "train") in COMMANDS


@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in (("index",), ("bench",))], ids=" ".join)
def test_help_exits_zero(command: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    if command == ("eval",):
        assert main(["eval", "--help"]) == 0
    else:
        with pytest.raises(SystemExit) as exit_info:
            main([*command, "--help"])
        assert exit_info.value.code == 0
    assert "usage" in capsys.readouterr().out


@pytest.mark.parametrize("task", sorted(schema.eval_tasks()))
def test_eval_task_help(task: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", task, "--help"])
    assert exit_info.value.code == 0 and "--batch-size" in capsys.readouterr().out


def _printed(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    from openalign.config import parse_yaml

    assert main([*argv, "--print-config"]) == 0, capsys.readouterr().err
    return parse_yaml(capsys.readouterr().out)


def test_print_config_is_yaml_plus_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "v.yaml").write_text("vocab_size: 500\nmin_frequency: 3\n")
    cfg = _printed(capsys, "vocab", "in.txt", "out", "--config", str(tmp_path / "v.yaml"), "--min-frequency", "4")
    assert cfg["vocab_size"] == 500 and cfg["min_frequency"] == 4 and cfg["lowercase"] is True
    assert _printed(capsys, "vocab", "a", "b", "--no-lowercase", "--max_length", "32")["max_length"] == 32

    (tmp_path / "b.yaml").write_text("batch_size: 8\nann: {kind: hnsw, hnsw_m: 16}\n")
    argv = ["index", "build", "--model", "m", "--images", "i", "--out", "o", "--config", str(tmp_path / "b.yaml")]
    cfg = _printed(capsys, *argv, "--ann.hnsw_m", "24", "--target-recall", "0.9")
    assert cfg["batch_size"] == 8 and cfg["ann"] == {**cfg["ann"], "kind": "hnsw", "hnsw_m": 24, "target_recall": 0.9}

    yaml_text = "train: {steps: 5}\nmodel: {preset: nano, embed_dim: 64}\ndata: {source: synthetic}\n"
    (tmp_path / "t.yaml").write_text(yaml_text)
    cfg = _printed(capsys, "train", "--config", str(tmp_path / "t.yaml"), "--train.run_dir", "runs/x")
    assert cfg["train"]["steps"] == 5 and cfg["train"]["run_dir"] == "runs/x" and cfg["model"]["embed_dim"] == 64

    (tmp_path / "f.yaml").write_text("rules: {max_words: 30}\nengine: {threads: 2}\n")
    cfg = _printed(capsys, "filter", "a.parquet", "b.parquet", "--config", str(tmp_path / "f.yaml"), "--rules", "cc12m",
                   "--set", "min_words=2", "--rules.columns.text", "alt", "--engine", "spark")  # fmt: skip
    assert cfg["rules"]["name"] == "cc12m" and cfg["rules"]["max_words"] == 30 and cfg["rules"]["min_words"] == 2
    assert cfg["rules"]["columns"]["text"] == "alt" and cfg["engine"] == {
        **cfg["engine"],
        "engine": "spark",
        "threads": 2,
    }

    cfg = _printed(capsys, "search", "idx", "--text", "a dog", "--plus", "red", "--plus", "blue", "-k", "3")
    assert cfg["plus"] == ["red", "blue"] and cfg["k"] == 3 and cfg["text"] == "a dog"
    cfg = _printed(capsys, "bench", "train", "--batch-size", "32", "--no-baseline", "--json", "r.json")
    assert cfg["batch_size"] == 32 and cfg["baseline"] is False and cfg["json_path"] == "r.json"
    assert _printed(capsys, "demo", "--quick", "--seed", "3", "--out", "x")["corpus_size"] == 3000


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["vocab", "a", "b", "--vocab-sise", "10"], "unknown config key 'vocab_sise'; valid keys: batch_size, column,"),
        (
            ["train", "--config", "nano_cpu", "--train.stepz", "3"],
            "unknown config key 'train.stepz'; valid keys in train:",
        ),
        (
            ["index", "build", "--model", "m", "--images", "i", "--out", "o", "--ann.nprobes", "3"],
            "valid keys in ann: ",
        ),
        (["serve", "--prot", "80"], "unknown config key 'prot'; valid keys: api_key, body_timeout_s,"),
        (["vocab", "a", "b", "--vocab-size", "many"], "vocab_size: expected an integer, got 'many'"),
        (["bench", "search", "--kind", "fast"], "kind: 'fast' is not one of 'auto', 'exact'"),
        (["train", "--config", "nano_cpu", "--train.steps", "x"], "train.steps: expected an integer, got 'x'"),
    ],
)
def test_bad_settings_are_one_line_errors(argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--print-config"]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1 and "Traceback" not in err


def test_unknown_key_in_yaml_lists_valid_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "d.yaml").write_text("clusterz: 8\n")
    assert main(["dedup", "a.npy", "b.npy", "out", "--config", str(tmp_path / "d.yaml"), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'dedup.clusterz'; valid keys in dedup: allow_outside_root, batch_size, chunk_size" in err


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """A command's --help on one line (argparse wraps at the terminal's width, and inside --no-KEY too)."""
    with mock.patch.dict("os.environ", {"COLUMNS": "100000"}), pytest.raises(SystemExit):
        main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_a_switch_that_is_on_is_listed_with_the_flag_its_help_describes(capsys: pytest.CaptureFixture[str]) -> None:
    """--KEY and --no-KEY on one line, the help saying what --KEY does: never --no-baseline beside "also run
    the transformers loop"."""
    text = _help(capsys, "bench", "train")
    assert "--baseline, --no-baseline also run the transformers loop and webdataset (--no-baseline: only ours)" in text
    assert "--training, --no-training time the training steps (--no-training: only the input pipeline)" in text
    assert "--baseline, --no-baseline also measure transformers' AlignModel" in _help(capsys, "bench", "model")
    text = _help(capsys, "bench", "copy-detection")
    assert "--feature-votes, --no-feature-votes also verify the pairs below the band" in text
    assert "(--no-feature-votes: no such column) (default on)" in text
    for argv, key in [(["bench", "train"], "baseline"), (["bench", "model"], "baseline"),
                      (["bench", "train"], "training"), (["bench", "copy-detection"], "feature_votes")]:  # fmt: skip
        flag = "--" + key.replace("_", "-")
        assert _printed(capsys, *argv)[key] is True
        assert _printed(capsys, *argv, "--no" + flag[1:])[key] is False
        assert _printed(capsys, *argv, "--no" + flag[1:], flag)[key] is True


JSON_BENCHES = ["model", "towers", "train", "search", "index", "serve", "filter", "dedup", "retrieval", "embed",
                "copy-detection"]  # fmt: skip


@pytest.mark.parametrize("bench", JSON_BENCHES)
def test_one_json_flag_per_command(bench: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--json FILE is the one flag of json_path: --json-path is neither listed nor accepted (a one-line error
    naming --json)."""
    text = _help(capsys, "bench", bench)
    assert "--json FILE also write the results to this JSON file" in text and "--json-path" not in text
    assert _printed(capsys, "bench", bench, "--json", "out.json")["json_path"] == "out.json"
    for spelling in ("--json-path", "--json_path"):
        assert main(["bench", bench, spelling, "out.json", "--print-config"]) == 2
        err = capsys.readouterr().err
        assert f"unknown option {spelling}: this command spells it --json" in err and err.count("\n") == 1


def test_an_alias_of_a_field_is_its_one_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert _printed(capsys, "demo", "--steps", "12")["train_steps"] == 12
    assert "--steps INT the nano_cpu recipe's horizon (default 900)" in _help(capsys, "demo")
    assert main(["demo", "--train-steps", "12", "--print-config"]) == 2
    assert "this command spells it --steps" in capsys.readouterr().err
    assert _printed(capsys, "bench", "search", "-k", "5")["k"] == 5
    # A nested field keeps its --section.key spelling beside the shorthand.
    cfg = _printed(capsys, "index", "build", "--model", "m", "--images", "i", "--out", "o", "--nprobe", "4")
    assert cfg["ann"]["nprobe"] == 4
    cfg = _printed(capsys, "index", "build", "--model", "m", "--images", "i", "--out", "o", "--ann.nprobe", "4")
    assert cfg["ann"]["nprobe"] == 4


def test_a_list_flag_reads_its_items_as_the_field_types_them(capsys: pytest.CaptureFixture[str]) -> None:
    """A list[float] field takes numbers from the command line; a list[str] field keeps text as typed."""
    assert _printed(capsys, "bench", "copy-detection", "--strengths", "0.5", "1")["strengths"] == [0.5, 1.0]
    assert _printed(capsys, "search", "idx", "--text", "red", "--plus", "001", "1.5")["plus"] == ["001", "1.5"]


def test_verify_votes_turns_verification_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """dedup --verify-votes alone verifies (the pairs the votes find are verified, so it asks for verification)."""
    assert "Implies --verify" in _help(capsys, "dedup")
    argv = ["dedup", "train/", "test/", "out", "--embedder", f"copy-detector:{tmp_path}", "--verify-votes"]
    cfg = _printed(capsys, *argv)
    assert cfg["verify"] is True and cfg["verify_votes"] is True
    assert main(["dedup", "a.npy", "b.npy", "out", "--verify-votes", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "dedup.verify_votes needs the images: use --embedder copy-detector:DIR" in err and err.count("\n") == 1


CONFIGS = [
    "openalign.data.filters.pipeline:FilterConfig",
    "openalign.data.dedup:DedupConfig",
    "openalign.pipeline.dedup:DedupRunConfig",
    "openalign.pipeline.copy_detector:CopyDetectorTrainConfig",
    "openalign.text.vocab:VocabConfig",
    "openalign.data.shard_config:ShardConfig",
    "openalign.train.config:TrainConfig",
    "openalign.config:ModelConfig",
    "openalign.search.build:BuildConfig",
    "openalign.search.query:Query",
    "openalign.search.api:ServeConfig",
    "openalign.pipeline.demo:DemoConfig",
    "openalign.pipeline.experiments:ExperimentSettings",
    "openalign.bench.model:BenchSettings",
    "openalign.bench.train_setup:TrainBenchSettings",
    "openalign.bench.search:SearchBenchSettings",
    "openalign.bench.search:ServeBenchSettings",
    "openalign.bench.filter:FilterBenchSettings",
    "openalign.bench.dedup_settings:DedupBenchSettings",
    "openalign.bench.retrieval:RetrievalBenchSettings",
    "openalign.pipeline.embed_shards:EmbedShardsConfig",
    "openalign.bench.embed:EmbedBenchSettings",
]


def _fields(cls: type, prefix: str = "") -> dict[str, object]:
    hints = typing.get_type_hints(cls)
    out: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        nested = next((a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)), None)
        if nested is not None:
            out.update(_fields(nested, f"{prefix}{f.name}."))
        elif f.default is not dataclasses.MISSING:
            out[prefix + f.name] = list(f.default) if isinstance(f.default, tuple) else f.default
        else:
            factory = f.default_factory
            out[prefix + f.name] = factory() if factory is not dataclasses.MISSING else schema.NO_DEFAULT
    return out


@pytest.mark.parametrize("spec", CONFIGS)
def test_flags_read_from_source_match_the_dataclass(spec: str) -> None:
    module, _, name = spec.partition(":")
    real = _fields(getattr(importlib.import_module(module), name))
    read = {k.path: k.default for k in schema.read(spec).knobs}
    assert read == real


def test_eval_options_read_from_source_match_the_registry() -> None:
    from openalign.eval.tasks import load_tasks

    tasks = load_tasks()
    static = schema.eval_tasks()
    assert sorted(static) == sorted(tasks)
    for name, task in tasks.items():
        declared = [
            (o.name, o.type.__name__, o.default, o.help, o.choices, o.metavar, o.required) for o in task.all_options()
        ]
        read = [(k.path, k.kind, k.default, k.help, k.choices, k.metavar, k.required) for k in static[name].options]
        assert read == declared and static[name].examples == task.examples


def test_cli_import_loads_no_torch() -> None:
    code = "import sys, openalign.cli, openalign; openalign.cli.build_parser(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("argv", [["copy-detector", "train", "--help"], ["dedup", "--help"]], ids=" ".join)
def test_pipeline_command_help_loads_no_torch(argv: list[str]) -> None:
    code = (
        "import contextlib, io, sys\nfrom openalign.cli import main\n"
        f"with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n    main({argv!r})\n"
        "assert 'usage' in out.getvalue() and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_names_load_lazily() -> None:
    import openalign
    from openalign import create_model, load_model  # noqa: F401

    assert callable(openalign.create_model) and "nano" in openalign.list_presets()
    with pytest.raises(AttributeError):
        _ = openalign.not_a_name


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["train", "--help"], ["eval", "--help"], ["filter", "--help"], ["copy-detector", "train", "--help"]],
    ids=" ".join,
)
def test_help_is_fast(argv: list[str]) -> None:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "openalign.cli", *argv], check=True, capture_output=True)
        best = min(best, time.perf_counter() - start)
    assert best < 2.0, f"openalign {' '.join(argv)} took {best:.2f} s"


@pytest.mark.parametrize("line", readme_lines())
def test_readme_command_lines_parse(line: str) -> None:
    """Every flag and argument the README shows is still accepted (running them is left to the stage tests)."""
    argv = shlex.split(line)[1:]
    args = build_parser().parse_args(argv)
    assert callable(args.func)


def test_a_batch_the_gpu_cannot_hold_is_one_line_naming_the_batch_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    import openalign.train.logging

    oom = (
        "CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.02 GiB "
        "is free. Including non-PyTorch memory, this process has 78.16 GiB memory in use. If reserved but unallocated "
        "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )

    def fails(*args: object) -> None:
        raise torch.OutOfMemoryError(oom)

    monkeypatch.setattr(openalign.train.logging, "plot_metrics", fails)  # any command that ran on a GPU
    assert main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "openalign plot: error: out of GPU memory (allocating 2.50 GiB; the GPU holds 79.19 GiB, 1.02 GiB of it "
        "free): lower the batch size"
    ]


def test_train_help_heads_each_tower_with_every_kind_the_recipes_pick(capsys: pytest.CaptureFixture[str]) -> None:
    """A group's heading is its config's first docstring line; above a recipe that trains the convnet with mean
    pooling it must not read as if only EfficientNet and the [CLS] vector existed."""
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    headings = {line.split(":")[0]: line for line in capsys.readouterr().out.splitlines() if line[:6] == "model."}
    assert "EfficientNet" in headings["model.image"] and "convnet" in headings["model.image"]
    assert "[CLS]" in headings["model.text"] and "mean" in headings["model.text"]
