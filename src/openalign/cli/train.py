"""``openalign train`` and ``openalign plot``."""

from __future__ import annotations

import argparse
import sys

from openalign.cli import schema
from openalign.cli.options import Parser, add_config, overrides, print_config


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser(
        "train", help="train or fine-tune a dual encoder (one process, or every process under torchrun)", build=_build
    )
    sub.add_parser("plot", help="plot a training run's loss, temperature, learning rate and held-out R@1", build=_plot)


def train_schema() -> schema.Schema:
    """TrainConfig's sections; the model section is ModelSection's preset and init plus every ModelConfig field."""
    run = schema.read("openalign.train.config:TrainConfig")
    model = schema.read("openalign.config:ModelConfig", "model.")
    knobs = [k for k in run.knobs if k.path != "model.overrides"]
    at = next(i for i, k in enumerate(knobs) if not k.path.startswith("model."))
    return schema.Schema(tuple(knobs[:at] + list(model.knobs) + knobs[at:]), run.sections + model.sections)


def _build(parser: Parser) -> None:
    parser.description = (
        "Train with the paper's contrastive loss from a YAML config (sections model, data, optim, train, log, eval) "
        "or a packaged recipe (pretrain_align, pretrain_align_b7, pretrain_align_mling, finetune_flickr30k, "
        "finetune_mscoco, nano_cpu). "
        "Any field can be overridden as --section.key VALUE (a YAML value; nested model fields as "
        "--model.image.batch_norm virtual); unknown keys are errors."
    )
    parser.epilog = (
        "examples:\n"
        "  openalign train --config nano_cpu --train.run_dir runs/nano\n"
        "  openalign train --config nano_cpu --train.run_dir runs/nano --resume latest\n"
        "  openalign train --config pretrain_align_b7 --data.shards 'shards/{00000..00999}.tar' \\\n"
        "      --data.tokenizer vocab/ --train.chunk_size 64           # 16384 pairs on one H100-80GB\n"
        "  torchrun --nproc-per-node 8 -m openalign.cli train --config pretrain_align \\\n"
        "      --data.shards 'shards/{00000..09999}.tar' --data.tokenizer vocab/\n"
        "  torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr HOST --master-port 29500 \\\n"
        "      -m openalign.cli train --config pretrain_align ...\n"
        "  openalign train --config finetune_flickr30k --model.init ./align-base --data.shards 'f30k/{0..29}.tar'\n"
        "  openalign train --config nano_cpu --print-config        # the resolved config, as YAML"
    )
    parser.add_argument("--config", required=True, metavar="CONFIG", help="YAML file or packaged recipe name")
    parser.add_argument(
        "--resume",
        metavar="latest|PATH",
        help="continue from RUN_DIR's newest checkpoint (latest; starts fresh if there is none) or a step_* dir",
    )
    add_config(parser, train_schema(), config_flag=False)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from openalign.train.config import load_train_config

    cfg = load_train_config(args.config, overrides(args))
    if args.print_config:
        print_config(cfg.to_dict())
        return 0
    from openalign.train.loop import NonFiniteError, OutOfMemoryError, train

    try:
        result = train(cfg, resume=args.resume)
    except (NonFiniteError, OutOfMemoryError) as err:
        print(f"openalign train: error: {err}", file=sys.stderr)
        return 3
    print(f"trained {result.step} steps; model: {result.final_dir}")
    return 0


def _plot(parser: Parser) -> None:
    parser.description = (
        "Draw loss, temperature, learning rate and held-out R@1 over steps from RUN_DIR/metrics.jsonl into one PNG."
    )
    parser.epilog = "examples:\n  openalign plot runs/nano\n  openalign plot runs/b7-base --out b7-base.png"
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory (or its metrics.jsonl)")
    parser.add_argument("--out", metavar="PNG", help="output image (default RUN_DIR/metrics.png)")
    parser.set_defaults(func=plot)


def plot(args: argparse.Namespace) -> int:
    from openalign.train.logging import plot_metrics

    print(f"wrote {plot_metrics(args.run_dir, args.out)}")
    return 0
