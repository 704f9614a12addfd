"""``openalign demo`` and ``openalign experiments``: the whole pipeline and the paper's ablations, in miniature."""

from __future__ import annotations

import argparse
from typing import Any

from openalign.cli import schema
from openalign.cli.options import Alias, Parser, add_config, data, print_config

DEMO = "openalign.pipeline.demo:DemoConfig"
EXPERIMENTS = "openalign.pipeline.experiments:ExperimentSettings"


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser(
        "demo",
        help="the whole pipeline on the built-in synthetic corpus (about ten minutes on two AVX-512 CPU cores)",
        build=_demo,
    )
    sub.add_parser(
        "multi30k-world",
        help="write the synthetic world's held-out scenes in Multi30K's layout, captioned in en, de, fr and cs",
        build=_multi30k_world,
    )
    sub.add_parser(
        "experiments",
        help="the paper's ablations in miniature: data noise vs size, temperature, negatives, embed dim, smoothing",
        build=_experiments,
    )


def _demo(parser: Parser) -> None:
    parser.description = (
        "Generate a noisy alt-text crawl, filter it with the ALIGN rules, remove near-duplicates of the test "
        "images, learn a WordPiece vocabulary, write shards, train the nano model, evaluate it zero-shot, index "
        "the shards and run example queries; writes report.md with tables and plots. A second run in the same "
        "folder reuses the finished stages."
    )
    parser.epilog = (
        "examples:\n  openalign demo\n  openalign demo --out runs/demo2 --steps 600\n"
        "  openalign demo --quick --seed 1\n  openalign demo --seeds 3 --out runs/demo3"
    )
    parser.add_argument("--quick", action="store_true", help="start from small sizes: about a minute, for a first look")
    parser.add_argument(
        "--seeds", type=int, default=1, metavar="N", help="run N seeds from --seed, in OUT/seed-S, and compare them"
    )
    add_config(parser, schema.read(DEMO), aliases=[Alias(("--steps",), "train_steps")])
    parser.set_defaults(func=run_demo)


def _with_base(args: argparse.Namespace, quick: Any) -> dict[str, Any]:
    """The settings: ``--quick``'s small sizes (when given) under the YAML file and the flags."""
    from openalign.config import merge, to_dict

    values = data(args)
    if not args.quick:
        return values
    base = to_dict(quick(values["out"]) if "out" in values else quick())
    return merge(base, values)


def run_demo(args: argparse.Namespace) -> int:
    from openalign.config import from_dict, to_dict
    from openalign.pipeline.demo import DemoConfig, quick_config

    cfg = from_dict(DemoConfig, _with_base(args, lambda out="runs/demo": quick_config(out)))
    cfg.validate()
    if args.print_config:
        print_config(to_dict(cfg))
        return 0
    from openalign.pipeline.demo import run_demo, run_demo_seeds

    if args.seeds > 1:
        run_demo_seeds(cfg, args.seeds)
    else:
        run_demo(cfg)
    return 0


def _multi30k_world(parser: Parser) -> None:
    parser.description = (
        "Write held-out scenes of the synthetic world as Multi30K's task-1 folder: OUT/image_splits/SPLIT.txt, "
        "OUT/raw/SPLIT.LANG (line i captions image i, in each language) and the images, for `openalign eval "
        "multilingual` or the paper-multilingual.yaml suite. The scenes are those of the retrieval set with the "
        "same seed, never training scenes."
    )
    parser.epilog = (
        "examples:\n"
        "  openalign multi30k-world runs/m30k --images 200\n"
        "  openalign multi30k-world DATA/multi30k --image-dir DATA/flickr30k-images   # the suite's layout"
    )
    parser.add_argument("out", metavar="OUT")
    parser.add_argument("--images", type=int, default=1000, metavar="N", help="images (default 1000, as Multi30K)")
    parser.add_argument(
        "--languages",
        default="en,de,fr,cs",
        metavar="L,L",
        type=lambda s: [p.strip() for p in s.split(",") if p.strip()],
        help="caption languages, from en,de,fr,cs (default all four)",
    )
    parser.add_argument("--seed", type=int, default=1, help="the held-out seed (default 1, the demo's test seed)")
    parser.add_argument("--image-size", type=int, default=64, metavar="PX", help="image side in pixels (default 64)")
    parser.add_argument("--split", default="test_2016_flickr", help="file stem (default test_2016_flickr)")
    parser.add_argument("--image-dir", metavar="DIR", help="where the images go (default OUT/images)")
    parser.set_defaults(func=run_multi30k_world)


def run_multi30k_world(args: argparse.Namespace) -> int:
    from openalign.data.synthetic import write_multi30k_set

    out = write_multi30k_set(
        args.out,
        args.images,
        args.languages,
        seed=args.seed,
        image_size=args.image_size,
        split=args.split,
        image_dir=args.image_dir,
    )
    images = args.image_dir or out / "images"
    print(
        f"{args.images} images in {images}, captions in {', '.join(args.languages)}: "
        f"{out / 'raw'}/{args.split}.<lang>, image list {out / 'image_splits' / (args.split + '.txt')}"
    )
    return 0


def _experiments(parser: Parser) -> None:
    parser.description = (
        "Train the nano model on the synthetic world several times with one factor changed (a: noisy data at "
        "1x/2x/4x the size of a clean set, with learning curves; b: learned vs fixed temperature; c: fraction of "
        "in-batch negatives; d: embedding size; e: label smoothing; f: 3 image x 3 text tower sizes), over "
        "several seeds; evaluate each final model on a held-out retrieval set and by KNN classification of its "
        "image embeddings; write OUT/experiments.json, OUT/experiments.md (mean ± std per variant, the paper's "
        "direction and the verdict measured here) and one plot per ablation in OUT/plots/. Finished runs are "
        "reused by a second invocation, so the grid can be run in parts."
    )
    parser.epilog = (
        "examples:\n"
        "  openalign experiments                         # the whole grid: 140 steps x 512 a run, 2 at a time\n"
        "  openalign experiments --only b,d --seeds 5\n"
        "  openalign experiments --quick --only e --seeds 1 --steps 3 --out /tmp/xp"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke test of the grid: 60 steps of batch 128 (below the trends)"
    )
    only = Alias(("--only",), "only", "ablations to run, from a,b,c,d,e,f (default all)", metavar="A,B",
                 type=lambda s: [p.strip() for p in s.split(",")])  # fmt: skip
    add_config(parser, schema.read(EXPERIMENTS), aliases=[only])
    parser.set_defaults(func=run_experiments)


def run_experiments(args: argparse.Namespace) -> int:
    from openalign.config import from_dict, to_dict
    from openalign.pipeline.experiments import ExperimentSettings, quick_settings

    settings = from_dict(ExperimentSettings, _with_base(args, quick_settings))
    settings.validate()
    settings.only = tuple(a for a in settings.only if a.strip())
    if args.print_config:
        print_config(to_dict(settings))
        return 0
    from openalign.pipeline.experiments import run_experiments

    run_experiments(settings)
    return 0
