"""``openalign bench towers`` at toy size: it runs, every figure is positive, ratios are ours / peer."""

from __future__ import annotations

import json

import pytest
import torch

from openalign.bench.towers import TowersBenchSettings, bert_peer, captions, run_towers_bench
from openalign.cli import main
from openalign.config import model_config
from openalign.model.dual_encoder import DualEncoder

pytest.importorskip("transformers")


def test_towers_bench_prints_ours_beside_each_peer(tmp_path, capsys, one_thread) -> None:
    out = tmp_path / "towers.json"
    settings = TowersBenchSettings(
        preset="nano", batch_size=4, image_size=32, vocab_size=1000, steps=1, rounds=2, warmup=0, json_path=str(out)
    )
    result = run_towers_bench(settings)
    assert json.loads(out.read_text())["text"] == result["text"]
    text, image = result["text"], result["image"]
    assert [row["model"].split(",")[0] for row in text] == [
        "openalign Bert 2x128",
        "transformers BertModel",
        "transformers BertModel",
    ]
    for rows in (text, image):
        assert all(row["median_ms"] > 0 and row["steps"] == 2 for row in rows)
        assert rows[0]["ratio"] is None
        for row in rows[1:]:
            assert row["ratio"] == pytest.approx(rows[0]["median_ms"] / row["median_ms"])
    printed = capsys.readouterr().out
    assert "bench towers: nano, batch 4" in printed and f"{text[1]['ratio']:.2f}x" in printed


def test_towers_bench_times_our_image_tower_again_with_cudnn_benchmark(one_thread) -> None:
    settings = TowersBenchSettings(
        preset="nano", towers="image", batch_size=2, image_size=32, steps=1, rounds=1, warmup=0, cudnn_benchmark=True
    )
    before = torch.backends.cudnn.benchmark
    image = run_towers_bench(settings)["image"]
    assert torch.backends.cudnn.benchmark is before  # put back
    ours, again = image[0], image[-1]
    assert again["model"] == f"{ours['model']}, cudnn.benchmark" and again["median_ms"] > 0
    assert again["ratio"] == pytest.approx(ours["median_ms"] / again["median_ms"])


def test_bert_peer_holds_our_text_weights_and_computes_our_features() -> None:
    torch.manual_seed(0)
    cfg = model_config("nano", text={"vocab_size": 1000, "pooling": "cls"})
    model = DualEncoder(cfg).eval()
    peer = bert_peer(model).eval()
    ids, mask = captions(6, 1000, seed=1)
    with torch.no_grad():
        theirs = peer(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
        torch.testing.assert_close(model.text(ids, mask), theirs, rtol=1e-5, atol=1e-5)
    assert mask.sum(1).min() >= 6 and mask.sum(1).max() <= 32 and ids.shape == (6, 64)


def test_towers_bench_command_parses(capsys) -> None:
    assert main(["bench", "towers", "--preset", "b0-tiny", "--towers", "text", "--print-config"]) == 0
    assert "towers: text" in capsys.readouterr().out
