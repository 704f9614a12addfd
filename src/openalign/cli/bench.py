"""``openalign bench …``: each benchmark's settings dataclass lives beside it in ``openalign.bench``."""

from __future__ import annotations

import argparse
from typing import Any

from openalign.cli import schema
from openalign.cli.options import Alias, Parser, add_config, data, print_config, str_value

JSON = Alias(("--json",), "json_path", "also write the results to this JSON file", type=str_value, metavar="FILE")
K = Alias(("-k",), "k", "results per query (default 10)")

# name: (settings class, help, description, examples, aliases)
BENCHES: dict[str, tuple[str, str, str, tuple[str, ...], tuple[Alias, ...]]] = {
    "model": (
        "openalign.bench.model:BenchSettings",
        "training throughput of a preset against transformers' AlignModel",
        "Forward+backward pairs/s, step time, peak memory and model FLOP utilisation for our dual encoder and "
        "for transformers' AlignModel built from the same config, in one run.",
        ("openalign bench model --preset b0-tiny",
         "openalign bench model --preset b3-mini --device cuda --bf16 --channels-last --compile --batch-size 64"),
        (JSON,
         Alias(("--channels-last",), "memory_format", "shorthand for --memory-format channels_last",
               value="channels_last"),
         Alias(("--memory-format",), "memory_format", "image layout: default (each model's own: ours NHWC, "
               "transformers NCHW), channels-last or contiguous for both", type=lambda s: s.replace("-", "_"),
               metavar="{default,channels-last,contiguous}")),
    ),
    "towers": (
        "openalign.bench.towers:TowersBenchSettings",
        "each tower alone (fwd + bwd): our BERT vs transformers' BertModel, our EfficientNet vs timm's",
        "Forward + backward of our text tower against transformers' BertModel (same config, same weights, the same "
        "captions of 6-32 tokens padded to 64; the peer also on them cut to the longest) and of our image tower "
        "against timm's efficientnet_bN and tf_efficientnet_bN of the same size (when timm is installed), "
        "channels-last, in alternating rounds in one process; prints the median step of each with the ratio "
        "ours / peer.",
        ("openalign bench towers                      # b0-mini on the CPU",
         "openalign bench towers --preset b0-base --towers text --steps 2 --rounds 3",
         "openalign bench towers --preset b7-base --device cuda --bf16 --batch-size 64 --image-size 289 --steps 20"),
        (JSON,),
    ),
    "train": (
        "openalign.bench.train_setup:TrainBenchSettings",
        "training steps from shards, split by phase, against a plain transformers AlignModel loop",
        "Pairs/s, time per step split into data / forward / loss / backward / optimizer, peak memory and MFU of "
        "our training step (dual encoder, contrastive loss, LAMB, our input stream) and of a plain loop over "
        "transformers' AlignModel (its own loss, torch AdamW) on the same batches of the same synthetic shards, "
        "in one run; then the input pipeline alone (samples/s in one process and per worker) against "
        "webdataset's pipeline. With --recipe, the real loop of `openalign train` (guard, schedule, logging) on the "
        "same model, batch and shards too, its pairs/s beside the bare step's.",
        ("openalign bench train", "openalign bench train --preset nano --batch-size 128 --steps 8",
         "openalign bench train --preset nano --batch-size 64 --recipe --virtual-batch-size 16 --no-baseline",
         "openalign bench train --preset b0-tiny --device cuda --bf16 --batch-size 256 --workers 8"),
        (JSON,),
    ),
    "search": (
        "openalign.bench.search:SearchBenchSettings",
        "approximate index vs exact NumPy search: build time, memory, latency, recall@10",
        "Index N clustered synthetic vectors and time single queries through it and through exact NumPy search "
        "on the same data, in one run; recall@k is measured against exact search.",
        ("openalign bench search                      # 1M × 640",
         "openalign bench search --n 200000 --kind hnsw --json search.json"),
        (JSON, K),
    ),
    "index": (
        "openalign.bench.ondisk:IndexBenchSettings",
        "on-disk IVF-PQ from embedding shards: build and serving memory, recall and latency vs exact search",
        "For each size, writes clustered vectors as clip-retrieval's inference folder, runs `openalign index build "
        "--embeddings` in a child process (its peak RSS beside the vectors' size), then opens the index "
        "memory-mapped in another child and prints its RSS beside the index file's size, recall@k and query latency "
        "beside exact search, and the metadata lookup beside reading the Parquet row groups.",
        ("openalign bench index                      # 1M, 2M and 4M × 64",
         "openalign bench index --sizes 200000 --dim 128 --shard-size 50000 --json index.json"),
        (JSON, K),
    ),
    "serve": (
        "openalign.bench.search:ServeBenchSettings",
        "load test: concurrent clients against the real search server on loopback",
        "Start `openalign serve` in its own process and send CLIENTS × REQUESTS POST /search (text, "
        "more-like-this and image+text queries) from concurrent clients; report p50/p99 and errors. Exits 1 if "
        "any request got a 5xx or failed.",
        ("openalign bench serve", "openalign bench serve --index photos.index --clients 32"),
        (JSON, K),
    ),
    "filter": (
        "openalign.bench.filter:FilterBenchSettings",
        "the ALIGN rules on DuckDB against a straightforward pandas implementation",
        "Writes a synthetic alt-text corpus (Zipf vocabulary, junk tokens, shared boilerplate, popular images, "
        "sizes around the thresholds) to Parquet, filters all of it with DuckDB and its first BASELINE_ROWS rows "
        "with pandas (time scaled to the full size), prints rows/s for both and the ratio, and checks that both "
        "keep the same rows of the subsample.",
        ("openalign bench filter                       # 10M rows, pandas on 1M",
         "openalign bench filter --rows 2000000 --baseline-rows 200000"),
        (JSON,),
    ),
    "dedup": (
        "openalign.bench.dedup_settings:DedupBenchSettings",
        "bucketed near-duplicate search against exact brute force (time, speed-up, recall)",
        "Synthetic embeddings with planted near-duplicates and near misses; our pipeline on all of them, brute "
        "force (blocked exact matrix products) on a train subsample, scaled to the full size. Prints both times, "
        "the ratio, and the recall against brute force.",
        ("openalign bench dedup                                  # 1M × 50k, 640-d",
         "openalign bench dedup --train 200000 --test 10000 --engine sparse",
         "openalign bench dedup --files --train 10000000 --test 10000 --memory-limit 2500MB --process-memory-gb 4"),
        (JSON, *(Alias((f"--{n.replace('_', '-')}",), f"dedup.{n}", f"same as --dedup.{n}",
                       type=str_value if n == "engine" else None)
                 for n in ("clusters", "nearest", "combo", "threshold", "engine", "project_dim", "chunk_size",
                           "memory_limit", "spark_master"))),
    ),
    "loss": (
        "openalign.bench.loss:LossBenchSettings",
        "the contrastive loss dense and a block of rows at a time: time and peak memory",
        "Forward + backward of the normalised-softmax loss (or, with --loss sigmoid, SigLIP's) over N embeddings, "
        "dense and with --block-rows "
        "(train.loss_block_rows), in alternating rounds in one process; prints each one's median step, the "
        "ratio, the peak bytes each adds and how far their values and gradients lie apart.",
        ("openalign bench loss", "openalign bench loss --loss sigmoid",
         "openalign bench loss --batches 1024 16384 --block-rows 512 --device cuda"),
        (JSON,),
    ),
    "retrieval": (
        "openalign.bench.retrieval:RetrievalBenchSettings",
        "recall_at_k on given embeddings against the bare matrix product it needs (time, ratio)",
        "MSCOCO-sized by default (5K images × 25K captions × 640-d, each caption its image's unit vector plus "
        "noise): the time of the one float32 image × caption matrix product every score needs, and of "
        "recall_at_k with float32 scores and at its default precision (bfloat16 with an exact recount where the "
        "CPU multiplies bfloat16 natively), in alternating rounds; checks both give the same recalls.",
        ("openalign bench retrieval", "openalign bench retrieval --images 1000 --independent"),
        (JSON, Alias(("--independent",), "noise", "captions independent of the images (noise: null)", value=None)),
    ),
    "embed": (
        "openalign.bench.embed:EmbedBenchSettings",
        "openalign embed by N torchrun processes beside one process (samples/s, ratio)",
        "Writes synthetic shards and an untrained preset, then embeds them with `openalign embed` as one plain "
        "process and under torchrun with N processes (CPU cores shared out among them; cuda:LOCAL_RANK on GPUs), "
        "in one run; prints samples/s of each, end to end, the ratio, and how far the two outputs differ.",
        ("openalign bench embed", "openalign bench embed --processes 4 --shards 16 --per-shard 256",
         "openalign bench embed --preset b0-tiny --processes 8 --batch-size 256   # 8 GPUs"),
        (JSON,),
    ),
    "copy-detection": (
        "openalign.bench.copy_detection:CopyBenchSettings",
        "finding reposted copies of real photographs: pHash, tiny image, our copy detector, + verification",
        "Real photographs shipped by installed packages (scikit-image, scikit-learn, matplotlib), each reposted by "
        "every transformation of openalign.data.reposting at several strengths and a few at once, among "
        "distractors (other photos, the other half of a halved reference). Scores every query against every "
        "reference: recall at a 0.1% false-positive rate and DISC21's micro-average precision, overall and per "
        "transformation, for a perceptual hash, a tiny-image descriptor, the copy detector untrained and trained "
        "on synthetic images only, and that detector with verification of the pairs near the threshold.",
        ("openalign bench copy-detection",
         "openalign bench copy-detection --detector copy_detector/ --verify-band 0.3 --json copies.json"),
        (JSON,),
    ),
    "gpu": (
        "openalign.bench.gpu:GpuCheckSettings",
        "the GPU path in one command: CUDA tests, ours against transformers, the paper's batch, plan vs measured",
        "Runs, each part in its own process with its own time limit within --budget-s (by default each part's "
        "share in full, ~16 minutes for the default parts; a part that fails or runs out of time is recorded and the "
        "next one starts): the CUDA tests, bench train (eager, profiled) and bench "
        "model (compiled) against transformers, bench towers, the training loop compiled and fed from JPEG shards "
        "(its data wait), pretrain_align_b7 at batch 64, and the plan of each run beside what it measured; with "
        "--paper, pretrain_align_b7 at the paper's 16384 batch with the peak host memory of its process tree and its "
        "peak GPU memory, and with --l2, pretrain_align at batch 512. Writes OUT/gpu_check.json and OUT/gpu_check.md "
        "and prints the markdown; exits 1 if a part failed or ran out of time.",
        ("openalign bench gpu --out gpu-check",
         "openalign bench gpu --out gpu-first --no-bench --no-towers --no-loop   # in two calls: tests, compiled,",
         "openalign bench gpu --out gpu-eager --no-tests --no-compiled --no-compiled-loop  # then eager (8 + 5 min)",
         "openalign bench gpu --out gpu-check --paper --l2 --no-compiled-loop --budget-s 580   # the memory runs",
         "openalign bench gpu --out gpu-check --update-table        # also record the measured pairs/s",
         "openalign bench gpu --device cpu --tiny --out /tmp/gc     # the check itself, at toy sizes, on a CPU"),
        (),
    ),
}  # fmt: skip


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("bench", help="benchmarks that print our figure beside a baseline from the same run", build=_bench)


def _bench(parser: Parser) -> None:
    benches = parser.add_subparsers(dest="bench", required=True, metavar="BENCH", parser_class=Parser)
    for name, (_, help_, *_rest) in BENCHES.items():
        benches.add_parser(name, help=help_, build=lambda p, n=name: _one(p, n))


def _one(parser: Parser, name: str) -> None:
    spec, _, description, examples, aliases = BENCHES[name]
    parser.description = description
    parser.epilog = "examples:\n" + "\n".join(f"  {e}" for e in examples)
    add_config(parser, schema.read(spec), aliases=aliases)
    parser.set_defaults(func=run, bench_spec=spec)


def settings(spec: str, values: dict[str, Any]) -> Any:
    """The benchmark's settings object, checked like every other config."""
    import importlib

    from openalign.config import from_dict

    module, _, cls = spec.partition(":")
    if cls == "DedupBenchSettings":  # the k-means seed follows the data seed unless given
        values = {**values, "dedup": {"seed": values.get("seed", 0), **(values.get("dedup") or {})}}
    out = from_dict(getattr(importlib.import_module(module), cls), values)
    if hasattr(out, "validate"):
        out.validate()
    if cls == "DedupBenchSettings":
        out.dedup.validate()
        if min(out.train, out.test, out.dim, out.brute_train, out.shard_rows) < 1:
            raise ValueError("--train, --test, --dim, --brute-train and --shard-rows must be positive")
    return out


def run(args: argparse.Namespace) -> int:
    from openalign.config import to_dict

    s = settings(args.bench_spec, data(args))
    if args.print_config:
        print_config(to_dict(s))
        return 0
    if args.bench == "model":
        from openalign.bench.model import run_model_bench

        run_model_bench(s)
    elif args.bench == "train":
        from openalign.bench.train import run_train_bench

        run_train_bench(s)
    elif args.bench == "search":
        from openalign.bench.search import run_search_bench

        run_search_bench(s)
    elif args.bench == "index":
        from openalign.bench.ondisk import run_index_bench

        run_index_bench(s)
    elif args.bench == "serve":
        from openalign.bench.search import run_serve_bench

        result = run_serve_bench(s)
        return 0 if result["server_errors"] == 0 and result["server_alive_after"] else 1
    elif args.bench == "filter":
        from openalign.bench.filter import run_filter_bench

        figures = run_filter_bench(
            s.rows, s.baseline_rows, seed=s.seed, threads=s.threads, top_k=s.top_k, work_dir=s.work_dir
        )
        if s.json_path:
            import json

            with open(s.json_path, "w") as f:
                json.dump(figures, f, indent=2)
    elif args.bench == "dedup":
        from openalign.bench.dedup import run_dedup_bench

        run_dedup_bench(s)
    elif args.bench == "towers":
        from openalign.bench.towers import run_towers_bench

        run_towers_bench(s)
    elif args.bench == "loss":
        from openalign.bench.loss import run_loss_bench

        run_loss_bench(s)
    elif args.bench == "retrieval":
        from openalign.bench.retrieval import run_retrieval_bench

        run_retrieval_bench(s)
    elif args.bench == "embed":
        from openalign.bench.embed import run_embed_bench

        run_embed_bench(s)
    elif args.bench == "copy-detection":
        from openalign.bench.copy_detection import run_copy_detection_bench

        run_copy_detection_bench(s)
    elif args.bench == "gpu":
        from openalign.bench.gpu import run_gpu_check

        return 0 if run_gpu_check(s)["ok"] else 1
    return 0
