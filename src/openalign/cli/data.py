"""``openalign filter | dedup | vocab | shard``: the data stages before training."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from openalign.cli import schema
from openalign.cli.options import Alias, Parser, add_config, data, print_config, str_value, yaml_value

if TYPE_CHECKING:
    from openalign.pipeline.dedup import DedupRun

FILTER = "openalign.data.filters.pipeline:FilterConfig"
DEDUP = "openalign.pipeline.dedup:DedupRunConfig"
VOCAB = "openalign.text.vocab:VocabConfig"
SHARD = "openalign.data.shard_config:ShardConfig"


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser(
        "filter", help="filter noisy alt-text pairs with the ALIGN (or CC12M) rules; prints the funnel", build=_filter
    )
    sub.add_parser(
        "dedup",
        help="find training images that near-duplicate test images (the ALIGN supplement) and drop them",
        build=_dedup,
    )
    sub.add_parser(
        "vocab",
        help="train the WordPiece vocabulary on alt-texts (HF tokenizers; loads in transformers too)",
        build=_vocab,
    )
    sub.add_parser("shard", help="write images and captions as WebDataset shards (img2dataset layout)", build=_shard)


def key_value(prefix: str, convert: Any = yaml_value) -> Any:
    """``--set KEY=VALUE`` style aliases: the value sets field ``prefix.KEY``."""

    def to(item: str) -> list[tuple[str, Any]]:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got '{item}'")
        return [(f"{prefix}.{key.strip()}", convert(value) if value.strip() else None)]

    return to


# --------------------------------------------------------------------------------------------------
# filter


def _filter(parser: Parser) -> None:
    parser.description = (
        "Apply ALIGN's frequency-based image and text filters (or CC12M's relaxed ones) to img2dataset-style "
        "metadata: Parquet, CSV/TSV, JSON Lines or WebDataset shards with url/key, a caption column, width, height "
        "and optional sha256 and unsafe score. Writes the surviving rows with every input column (format by "
        "OUTPUT's extension; with --engine spark a directory of part files) and prints the funnel: rows in, rows "
        "removed by each rule in order, rows out. Rule fields are --rules.FIELD VALUE (or --set FIELD=VALUE)."
    )
    parser.epilog = (
        "examples:\n"
        "  openalign filter pairs.parquet kept.parquet --report funnel.json\n"
        "  openalign filter pairs.csv kept.jsonl --rules cc12m --nlp en_core_web_sm\n"
        "  openalign filter 'shards/{00000..00009}.tar' kept.parquet --rules cc12m --nlp en_core_web_sm "
        "--tagger runs/b3/final --tag-vocab tags.txt\n"
        "  openalign filter 'shards/{00000..00009}.tar' kept.parquet --set vocab_top_k=1000000 --rules.max_words 30\n"
        "  openalign filter 'parts/*.parquet' kept.parquet --engine spark --spark-master spark://head:7077\n"
        "  openalign filter pairs.parquet kept.parquet --rules my_rules.yaml   # YAML: preset: align, max_words: 30\n"
        "  openalign filter pairs.parquet kept.parquet --config filter.yaml    # YAML: rules: {...}, engine: {...}"
    )
    parser.add_argument("input", metavar="INPUT", help="file, directory, glob, or WebDataset shard spec")
    parser.add_argument("output", metavar="OUTPUT", help=".parquet, .csv, .tsv or .jsonl")
    parser.add_argument(
        "--rules", metavar="RULES", help="rule set to start from: align (default), cc12m, or RULES.yaml"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    aliases = (
        Alias(("--set",), key_value("rules"), "set a rule field (repeatable), same as --rules.KEY VALUE",
              metavar="KEY=VALUE", type=str),
        Alias(("--engine",), "engine.engine", "duckdb (default) or spark", type=str_value, metavar="{duckdb,spark}"),
        Alias(("--text-column",), "rules.columns.text", "alt-text column (default: caption, alt, alt_text, text, TEXT)",
              type=str_value),
        Alias(("--threads",), "engine.threads", "duckdb: threads (default: all cores)"),
        Alias(("--memory-limit",), "engine.memory_limit", "duckdb: memory before spilling, e.g. 8GB", type=str_value),
        Alias(("--temp-dir",), "engine.temp_directory", "work files and spill directory", type=str_value),
        Alias(("--spark-master",), "engine.spark_master", "spark: master URL (default local[*])", type=str_value),
        Alias(("--spark-conf",), key_value("engine.spark_conf", str), "spark: extra setting (repeatable)",
              metavar="KEY=VALUE", type=str),
    )  # fmt: skip
    add_config(parser, schema.read(FILTER), aliases=aliases)
    parser.set_defaults(func=run_filter)


def filter_config(args: argparse.Namespace) -> Any:
    from openalign.config import from_dict
    from openalign.data.filters import load_rules
    from openalign.data.filters.pipeline import FilterConfig

    settings = data(args)
    rules = settings.pop("rules", None) or {}
    cfg = from_dict(FilterConfig, settings)
    if args.rules is not None and "preset" not in rules:
        cfg.rules = load_rules(args.rules, **rules)
    else:
        cfg.rules = load_rules(rules)
    cfg.engine.spark_conf = {k: str(v) for k, v in cfg.engine.spark_conf.items()}
    if cfg.engine.threads is not None and cfg.engine.threads < 1:
        raise ValueError(f"--threads must be positive, got {cfg.engine.threads}")
    return cfg


def run_filter(args: argparse.Namespace) -> int:
    from openalign.config import to_dict
    from openalign.data.filters import filter_corpus

    cfg = filter_config(args)
    if args.print_config:
        print_config(to_dict(cfg))
        return 0
    tagger = None
    if cfg.tagger is not None:
        from openalign.pipeline.tagging import ZeroShotTagger

        tagger = ZeroShotTagger.from_files(cfg.tagger, cfg.tag_vocab, cfg.tag_top_k)
    report = filter_corpus(
        args.input,
        args.output,
        cfg.rules,
        engine=cfg.engine,
        input_format=cfg.input_format,
        max_malformed_rows=cfg.max_malformed_rows,
        report_path=cfg.report,
        person_hook=cfg.person_names,
        nlp=cfg.nlp,
        nlp_batch_size=cfg.nlp_batch_size,
        image_tagger=tagger,
        overwrite=cfg.overwrite,
        progress=not args.quiet,
    )
    print(report.table())
    print(f"wrote {args.output}" + (f" and {cfg.report}" if cfg.report else ""))
    return 0


# --------------------------------------------------------------------------------------------------
# dedup


def _dedup(parser: Parser) -> None:
    parser.description = (
        "k-means clusters on the train embeddings; each image's nearest clusters; every combination of COMBO of "
        "them is a bucket; train/test pairs sharing a bucket are compared, and a pair with cosine > THRESHOLD is "
        "a near-duplicate. Writes duplicates.parquet and duplicates.csv (every pair), drop.parquet + drop.json "
        "(train images to remove), stats.json and, with --metadata, the table without those images. With "
        "--embedder npy (the default) TRAIN/TEST are .npy embeddings; with --embedder copy-detector:DIR (a "
        "detector from `openalign copy-detector train`) or align:DIR (an ALIGN checkpoint's image tower) they "
        "are image folders, tables or shards, embedded first (embeddings and keys are kept in OUT_DIR). TRAIN/TEST "
        "may also be folders in clip-retrieval's inference layout (img_emb/, metadata/ with a --key-column): then, "
        "as with --engine spark or --out-of-core, bucket keys go to Parquet and DuckDB (within --memory-limit, "
        "spilling to --temp-directory) or Spark (--spark-master) joins them."
    )
    parser.epilog = (
        "examples:\n"
        "  openalign dedup train.npy test.npy dedup/ --train-keys train_keys.txt --metadata filtered.parquet\n"
        "  openalign dedup crawl/ eval_images/ dedup/ --embedder copy-detector:copy_detector/\n"
        "  openalign dedup 'shards/{00000..00099}.tar' eval_images/ dedup/ --embedder align:runs/b3/final\n"
        "  openalign dedup train.npy test.npy dedup/ --clusters 1024 --engine sparse\n"
        "  openalign dedup crawl_emb/ test_emb/ dedup/ --memory-limit 8GB --metadata filtered.parquet\n"
        "  openalign dedup crawl_emb/ test_emb/ dedup/ --engine spark --spark-master spark://host:7077"
    )
    parser.add_argument("train", metavar="TRAIN", help="train embeddings .npy, or an image folder / table / shards")
    parser.add_argument("test", metavar="TEST", help="test embeddings .npy, or an image folder / table / shards")
    parser.add_argument("out", metavar="OUT_DIR")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    model = Alias(("--model",), lambda ckpt: [("embedder", f"align:{ckpt}")], "same as --embedder align:CKPT",
                  type=str, metavar="CKPT")  # fmt: skip
    add_config(parser, schema.read(DEDUP), aliases=[model], config_help="YAML file of dedup settings (flags override)")
    parser.set_defaults(func=run_dedup)


def dedup_config(settings: dict[str, Any]) -> Any:
    from openalign.config import from_dict
    from openalign.pipeline.dedup import DedupRunConfig

    cfg = from_dict(DedupRunConfig, settings, "dedup")
    cfg.validate()
    return cfg


def _verdicts(counts: dict[str, int]) -> str:
    return (
        f"{counts.get('aligned', 0):,} accepted by aligned pixels, {counts.get('phash', 0):,} by pHash, "
        f"{counts.get('features', 0):,} by feature matching, {counts.get('rejected', 0):,} rejected"
    )


def dedup_summary(run: DedupRun) -> list[str]:
    """The lines ``openalign dedup`` prints about a ``DedupRun``: counts that add up to the rows of
    duplicates.csv, the pairs above the threshold told apart from those verification accepted below it."""
    st = run.result.stats
    source = {"detector": "fitted by the copy detector", "default": "default", "setting": "set"}
    threshold = f"cosine > {st['threshold']:.4f}, {source.get(st['threshold_source'], st['threshold_source'])}"
    head = f"{run.train_images:,} train × {run.test_images:,} test images, {st.get('clusters', 0)} clusters: "
    head += f"{run.candidate_pairs:,} candidate pairs, {run.duplicate_pairs:,} near-duplicate pairs "
    v = st.get("verification")
    if v is None:
        head += f"({threshold})"
    else:
        above = int(st.get("pairs_above_threshold", run.duplicate_pairs))
        voted = int(v.get("accepted_voted", 0))
        head += f"({above:,} with {threshold}; {run.duplicate_pairs - above:,} below it, accepted by their pixels"
        head += f"; {voted:,} proposed by votes)" if v.get("pairs_voted") else ")"
    lines = [head + f", {run.train_rows_removed:,} train images to drop"]
    if v is not None:
        band = {"aligned": v.get("accepted_by_aligned_pixels", 0), "phash": v["accepted_by_phash"]}
        band.update(features=v["accepted_by_features"], rejected=v["rejected"])
        line = (
            f"decided by the embedding alone: {v['pairs_by_embedding']:,} pairs; by verification (cosine in "
            f"({v['band'][0]:.3f}, {v['band'][1]:.3f}]): {v['pairs_verified']:,} pairs, {_verdicts(band)}"
        )
        if v.get("pairs_beyond_nearest"):
            line += f"; {v['pairs_beyond_nearest']:,} pairs beyond each image's nearest"
        if v.get("pairs_voted"):
            line += f"; proposed by votes: {v['pairs_voted']:,} pairs, {_verdicts(v.get('voted', {}))}"
        lines.append(line)
    for side, reasons in run.skipped.items():
        if reasons:
            lines.append(f"skipped {side} images: {', '.join(f'{reason} {n}' for reason, n in reasons.items())}")
    invalid = {side: int(st.get(f"{side}_skipped_invalid", 0)) for side in ("train", "test")}
    if any(invalid.values()):
        counted = " and ".join(f"{n:,} {side}" for side, n in invalid.items() if n)
        lines.append(f"skipped {counted} embeddings that are NaN, infinite or zero (not compared)")
    if run.table is not None:
        m = run.table
        lines.append(f"metadata: {m['rows_in']:,} rows in, {m['rows_removed']:,} removed, {m['rows_out']:,} out")
    return lines


def run_dedup(args: argparse.Namespace) -> int:
    from openalign.config import to_dict

    settings = data(args)
    cfg = dedup_config(settings)
    if args.print_config:
        print_config(to_dict(cfg))
        return 0
    from openalign.pipeline.dedup import run_dedup

    # A threshold given by flag or in --config wins; otherwise a copy detector's fitted one is used.
    fitted = "threshold" not in settings
    run = run_dedup(args.train, args.test, args.out, cfg, progress=not args.quiet, detector_threshold=fitted)
    for note in run.result.notes:
        print(f"note: {note}", file=sys.stderr)
    for line in dedup_summary(run):
        print(line)
    print(f"wrote {', '.join(str(p) for p in run.paths.values())}")
    return 0


# --------------------------------------------------------------------------------------------------
# vocab


def _vocab(parser: Parser) -> None:
    parser.description = (
        "Learn a BERT WordPiece vocabulary from captions streamed from Parquet, CSV, JSON Lines, plain text (one "
        "caption per line) or WebDataset shards (txt members). Writes tokenizer.json, vocab.txt, "
        "tokenizer_config.json, special_tokens_map.json and vocab_stats.json; null, empty and non-UTF-8 captions "
        "are skipped and counted."
    )
    parser.epilog = (
        "examples:\n"
        "  openalign vocab corpus/filtered.parquet vocab/\n"
        "  openalign vocab captions.txt vocab/ --vocab-size 32000 --min-frequency 5\n"
        "  openalign vocab 'shards/{00000..00099}.tar' vocab/ --no-lowercase"
    )
    parser.add_argument("input", metavar="INPUT", help=".parquet (file or folder), .csv, .jsonl, .txt, or shards")
    parser.add_argument("out", metavar="OUT_DIR")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_config(parser, schema.read(VOCAB))
    parser.set_defaults(func=run_vocab)


def run_vocab(args: argparse.Namespace) -> int:
    from openalign.config import from_dict, to_dict
    from openalign.text.vocab import VocabConfig, build_vocab

    cfg = from_dict(VocabConfig, data(args))
    cfg.validate()
    if args.print_config:
        print_config(to_dict(cfg))
        return 0
    tokenizer, stats = build_vocab(args.input, args.out, cfg, progress=not args.quiet)
    skipped = sum(stats["skipped"].values())
    print(
        f"{stats['captions']:,} captions ({skipped:,} skipped{': ' + str(stats['skipped']) if skipped else ''}) "
        f"-> {tokenizer.vocab_size:,} wordpieces in {args.out}"
    )
    return 0


# --------------------------------------------------------------------------------------------------
# shard


def _shard(parser: Parser) -> None:
    parser.description = (
        "Write WebDataset tars (key.jpg / key.txt / key.json, a NNNNN_stats.json per shard) from an image folder "
        "with captions, a Parquet table with an image-bytes column, or a metadata table (Parquet/CSV/JSONL, e.g. "
        "the output of `openalign filter`) whose image_path column points to files. Every metadata column is kept "
        "in key.json; unreadable images are skipped and counted by reason."
    )
    parser.epilog = (
        "examples:\n"
        "  openalign shard photos/ shards/                       # photos/cat.jpg + photos/cat.txt ...\n"
        "  openalign shard photos/ shards/ --captions captions.csv --max-side 512\n"
        "  openalign shard pairs.parquet shards/ --image-column jpg --caption-column text\n"
        "  openalign shard corpus/filtered.parquet shards/ --image-root corpus --samples-per-shard 10000"
    )
    parser.add_argument("input", metavar="INPUT", help="image folder, or .parquet/.csv/.tsv/.jsonl table")
    parser.add_argument("out", metavar="OUT", help="output folder for the shards")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_config(parser, schema.read(SHARD))
    parser.set_defaults(func=run_shard)


def run_shard(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from openalign.config import from_dict
    from openalign.data.shard_config import ShardConfig

    cfg = from_dict(ShardConfig, data(args))
    if args.print_config:
        print_config(asdict(cfg))
        return 0
    from openalign.data.shards import shard_input

    totals = shard_input(args.input, args.out, **asdict(cfg), progress=not args.quiet)
    skipped = ", ".join(f"{reason} {n}" for reason, n in totals.failures.items())
    print(
        f"wrote {totals.successes} samples in {totals.shards} shards ({totals.bytes / 1e6:.1f} MB) to "
        f"{args.out}; skipped {totals.failed}{f' ({skipped})' if skipped else ''}"
    )
    return 0
