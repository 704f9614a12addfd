"""Measured step rates: the shipped table, record/load, lookup, and the plan's time taken from them."""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
from pathlib import Path

import pytest

from openalign.cli import main
from openalign.train import plan as P
from openalign.train import throughput as T

ROOT = Path(__file__).resolve().parents[1]


def _row(**kw: object) -> T.Measurement:
    base: dict[str, object] = dict(
        config="pretrain_align_b7",
        image="b7",
        text="bert-base",
        device="h200-141gb",
        gpu="NVIDIA H200",
        batch=64,
        chunk=None,
        image_size=289,
        text_length=64,
        precision="bf16",
        compiled=False,
        pairs_per_s=78.0,
        date="2026-11-26",
        commit="08e9910",
        note="",
    )
    return T.Measurement(**{**base, **kw})  # type: ignore[arg-type]


def test_shipped_table_holds_the_h200_measurements_and_is_package_data(tmp_path: Path) -> None:
    rows = T.load_measurements()
    seen = {(m.config, m.batch, m.chunk): m for m in rows}
    assert seen[("pretrain_align_b7", 64, None)].pairs_per_s == 147.4
    assert seen[("pretrain_align_b7", 16384, 64)].pairs_per_s == 103.0
    assert seen[("pretrain_align", 512, 128)].pairs_per_s == 27.7
    for m in rows:
        assert m.device in P.DEVICES and m.gpu and m.commit and m.date.count("-") == 2
    # An installed wheel carries the table: pyproject's package data must match its path.
    # (tomllib is 3.11+; the line is a Python list literal.)
    section = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1]
    patterns = ast.literal_eval(section.split("openalign = ", 1)[1].splitlines()[0])
    assert any(fnmatch.fnmatch("train/throughput.json", p) for p in patterns)
    # The shipped file is as record writes it (sorted, deterministic).
    assert T.record(rows, tmp_path / "copy.json").read_bytes() == T.TABLE.read_bytes()


def test_record_then_load_round_trips_and_replaces_by_key(tmp_path: Path) -> None:
    a = _row()
    b = _row(batch=1024, chunk=64, pairs_per_s=63.8, peak_gib=32.35)
    c = _row(config="pretrain_align", image="l2", text="bert-large", batch=512, chunk=128, pairs_per_s=27.7)
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    assert T.record([a, b, c], one) == one
    T.record([c, b, a], two)
    assert one.read_bytes() == two.read_bytes()  # the same rows write the same bytes, in any order
    assert sorted(T.load_measurements(one), key=T.Measurement.key) == sorted([a, b, c], key=T.Measurement.key)
    newer = dataclasses.replace(b, pairs_per_s=70.0, date="2026-12-01", commit="abc1234")
    T.record([newer], one)
    rows = T.load_measurements(one)
    assert len(rows) == 3 and newer in rows and b not in rows


def test_lookup_picks_the_closest_row_of_the_same_family_and_device() -> None:
    rows = [
        _row(),
        _row(batch=1024, chunk=64, pairs_per_s=63.8),
        _row(batch=1024, chunk=128, pairs_per_s=66.0),
        _row(batch=1024, chunk=64, pairs_per_s=120.0, compiled=True),
        _row(batch=64, image_size=224, pairs_per_s=130.0),
        _row(device="a100-80gb", gpu="NVIDIA A100", pairs_per_s=30.0),
        _row(config="pretrain_align", image="l2", text="bert-large", batch=512, chunk=128, pairs_per_s=27.7),
    ]

    def pick(device: str = "h200-141gb", world: int = 1, **overrides: object) -> T.Measurement | None:
        cfg = P.load_plan_config("pretrain_align_b7", dict(overrides))
        return T.lookup(cfg, device, rows, world_size=world)

    assert pick(**{"train.batch_size": 64}) == rows[0]  # the same step
    # 16384 in chunks of 64: on a GPU the towers compile unless told not to (train.compile null).
    assert pick(**{"train.chunk_size": 64}) == rows[3]
    assert pick(**{"train.chunk_size": 64, "train.compile": False}) == rows[1]  # the chunked eager row
    assert pick(**{"train.chunk_size": 128}) == rows[2]
    assert pick(**{"train.chunk_size": 64, "train.compile": True}) == rows[3]
    assert pick(**{"train.batch_size": 128}) == rows[0]  # no chunks: the uncached row, not a cached one
    assert pick(**{"train.batch_size": 64, "data.image_size": 224}) == rows[4]
    assert pick(world=256, **{"train.batch_size": 16384}) == rows[0]  # 64 per device
    assert pick("a100-80gb", **{"train.batch_size": 64}) == rows[5]
    assert pick("h100-80gb") is None  # never measured there
    l2 = P.load_plan_config("pretrain_align", {})
    assert T.lookup(l2, "h200-141gb", rows) == rows[6]
    assert T.measured_devices(l2, rows) == ["h200-141gb"]
    assert T.lookup(P.load_plan_config("nano_cpu", {}), "h200-141gb", rows) is None


def test_family_is_the_towers_architecture() -> None:
    assert T.family(P.load_plan_config("pretrain_align_b7", {}).model.resolve()) == ("b7", "bert-base")
    assert T.family(P.load_plan_config("pretrain_align", {}).model.resolve()) == ("l2", "bert-large")
    assert T.family(P.load_plan_config("nano_cpu", {}).model.resolve())[0] == "custom"
    # Only the fields a family builds from count: nano_cpu's convnet layers do not make B0 another family.
    b0 = P.load_plan_config(
        "nano_cpu",
        {"model.preset": "b0-tiny", "model.image.family": "efficientnet", "model.image.strides": [1, 2, 2, 2, 1, 2, 1]},
    ).model.resolve()
    assert b0.image.conv_channels != P.load_plan_config("pretrain_align", {}).model.resolve().image.conv_channels
    assert T.family(b0)[0] == "b0"
    widened = P.load_plan_config("nano_cpu", {"model.image.width_coefficient": 2.0}).model.resolve()
    assert T.family(widened) == T.family(P.load_plan_config("nano_cpu", {}).model.resolve())


B0 = ["--config", "nano_cpu", "--model.preset", "b0-tiny", "--model.image.family", "efficientnet"]
B0 += ["--model.image_size", "32", "--data.max_text_length", "8"]


def test_plan_time_is_the_measured_rate_scaled_to_the_batch_and_world(tmp_path: Path) -> None:
    # A fast model family (B0 + BERT-Tiny at 32 px) with a made-up measurement on the H200: per-device pairs/s
    # held, so 2 devices of 16 pairs each take 16 / 40 s and move 2 × 40 pairs/s.
    cfg = P.load_plan_config(
        "nano_cpu",
        {
            "model.preset": "b0-tiny",
            "model.image.family": "efficientnet",  # B0's own tower and strides (nano_cpu changes both)
            "model.image.strides": [1, 2, 2, 2, 1, 2, 1],
            "model.image_size": 32,
            "data.max_text_length": 8,
            "train.batch_size": 32,
            "train.precision": "bf16",
        },
    )
    m = _row(config="custom", image="b0", text="bert-tiny", batch=16, image_size=32, text_length=8, pairs_per_s=40)
    h200, h100 = P.device_spec("h200-141gb"), P.device_spec("h100-80gb")
    with P.session(cfg, h200, 2) as steps:
        p = P.plan(cfg, h200, 2, steps=steps, measurements=[m])
        assert p.measurement == m and p.step_seconds == pytest.approx(16 / 40) and p.pairs_per_second == 80
        rows = dict(P.describe(p))
        assert "NVIDIA H200" in rows["measured"] and "08e9910" in rows["measured"] and "2026-11-26" in rows["measured"]
        assert "communication not counted" in rows["assumes"]
        none = dict(P.describe(P.plan(cfg, h100, 2, steps=steps, measurements=[m])))
        assert none["step time"].startswith("not measured on h100-80gb") and "h200-141gb" in none["step time"]
        assert "throughput" not in none
        forced = P.plan(cfg, h100, 2, steps=steps, mfu=0.5, measurements=[m])
        assert forced.step_seconds == pytest.approx(forced.flops / (989e12 * 0.5))
        assert "--mfu 0.5" in dict(P.describe(forced))["step time"]


def test_plan_command_mfu_is_an_labelled_override(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", *B0, "--device", "h100-80gb", "--train.batch_size", "8", "--no-search", "--mfu", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "from the FLOPs at --mfu 0.3 of 989 TFLOP/s" in out and "an --mfu override, not a measurement" in out


def test_b7_plan_says_measured_or_not_measured_time() -> None:
    # The paper's B7 recipe with the shipped table: on an H100 no step rate was measured, so the plan says so and
    # gives no time; on the H200 it gives the measured rate and where and when it was measured. Never an assumed
    # MFU. Both devices compute in bf16, so one fake step serves both plans (`openalign plan` prints these rows).
    cfg = P.load_plan_config("pretrain_align_b7", {"train.batch_size": 64})
    h100, h200 = P.device_spec("h100-80gb"), P.device_spec("h200-141gb")
    with P.session(cfg, h200) as steps:
        printed = {
            dev.name: "\n".join(f"{k}: {v}" for k, v in P.describe(P.plan(cfg, dev, steps=steps)))
            for dev in (h100, h200)
        }
    for out in printed.values():
        assert "TFLOP/s" not in out and "MFU" not in out.upper().replace("--MFU F", "")
    time = {
        name: next(line for line in out.splitlines() if line.startswith("step time")) for name, out in printed.items()
    }
    assert "not measured on h100-80gb" in time["h100-80gb"] and "h200-141gb" in time["h100-80gb"]
    assert "pairs/s" not in printed["h100-80gb"]
    assert "0.43 s" in time["h200-141gb"]  # 64 pairs at the 147.4 pairs/s measured at this very step
    assert "147.4 pairs/s on one NVIDIA H200" in printed["h200-141gb"]
    assert "2026-11-26, commit 46d0d3a" in printed["h200-141gb"]
