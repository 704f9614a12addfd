"""``openalign copy-detector train``: the image model ``dedup --embedder copy-detector:DIR`` embeds with."""

from __future__ import annotations

import argparse

from openalign.cli import schema
from openalign.cli.options import Parser, add_config, data, print_config

TRAIN = "openalign.pipeline.copy_detector:CopyDetectorTrainConfig"


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser(
        "copy-detector",
        help="train the copy detector that finds near-duplicates of test images (dedup --embedder copy-detector:DIR)",
        build=_group,
    )


def _group(parser: Parser) -> None:
    actions = parser.add_subparsers(dest="copy_detector_command", required=True, metavar="ACTION", parser_class=Parser)
    actions.add_parser(
        "train", help="train a copy detector on unlabelled images (a folder, a table or shards)", build=_train
    )


def _train(parser: Parser) -> None:
    parser.description = (
        "Train the ALIGN supplement's 'separate high-quality image embedding model' for near-duplicate removal on "
        "the crawl's own images, without labels: two reposting-style views of each image (re-crop, rescale, "
        "colour change, JPEG re-encode) are a positive pair, the other images of the batch negatives. SOURCE is "
        "anything the image-reading commands accept: an image folder, a table (.parquet/.csv/.jsonl with image "
        "bytes or an image_path column) or WebDataset shards; unreadable items are skipped and counted. Writes "
        "OUT_DIR/config.json + model.safetensors, for `openalign dedup --embedder copy-detector:OUT_DIR`. Distinct "
        "images beyond the --max-images trained on (up to --fit.holdout) are held out: each gets reposted copies, "
        "and the lowest cosine whose false-positive rate on pairs of different images is at most "
        "--fit.max_false_positive_rate becomes the detector's threshold (train.threshold in config.json, the "
        "precision-recall curve in OUT_DIR/threshold_curve.csv), which dedup then uses unless --threshold is given."
    )
    parser.epilog = (
        "examples:\n"
        "  openalign copy-detector train crawl/ copy_detector/\n"
        "  openalign copy-detector train 'shards/{00000..00099}.tar' copy_detector/ --steps 1000 --batch-size 256\n"
        "  openalign copy-detector train filtered.parquet copy_detector/ --seconds 600 --augment.crop 0.1\n"
        "  openalign copy-detector train crawl/ copy_detector/ --max-images 5000 --fit.max_false_positive_rate 1e-3"
    )
    parser.add_argument("source", metavar="SOURCE", help="image folder, table (.parquet/.csv/.jsonl) or shards")
    parser.add_argument("out", metavar="OUT_DIR", help="where the detector is saved")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_config(parser, schema.read(TRAIN), config_help="YAML file of training settings (augment: nested)")
    parser.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    from openalign.config import from_dict, to_dict
    from openalign.pipeline.copy_detector import CopyDetectorTrainConfig, train_copy_detector_from_source

    cfg = from_dict(CopyDetectorTrainConfig, data(args), "copy_detector")
    cfg.validate()
    if args.print_config:
        print_config(to_dict(cfg))
        return 0
    run = train_copy_detector_from_source(args.source, args.out, cfg, progress=not args.quiet)
    st = run.stats
    losses = st.get("losses") or [float("nan")]
    # Unreadable items by reason: the source's, and images whose pixels would not convert once decoded.
    reasons = {**run.skipped, "unconvertible": st.get("unreadable", 0)}
    parts = [f"{st['exact_duplicates']:,} exact duplicates"] if st.get("exact_duplicates") else []
    if sum(reasons.values()):
        counted = ", ".join(f"{reason} {n:,}" for reason, n in reasons.items() if n)
        parts.append(f"{sum(reasons.values()):,} unreadable: {counted}")
    skipped = ", ".join(parts)
    print(
        f"trained {run.steps} steps of {st['batch_size']} images on {run.images_used:,} distinct images"
        f"{f' (skipped {skipped})' if skipped else ''} in {st['train_seconds']:.0f} s; "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; wrote {run.path}"
    )
    if run.fit is not None:
        print(f"{run.fit.report()}; curve in {run.path / 'threshold_curve.csv'}")
    elif cfg.fit.holdout:
        print(
            f"note: no threshold fitted: the source has no distinct images beyond the {run.images_used:,} trained "
            "on (lower --max-images to hold some out); dedup will use its --threshold"
        )
    return 0
