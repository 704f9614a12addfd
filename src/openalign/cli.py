"""``openalign <command>``: parses arguments, checks them, and calls the library. Nothing else lives here."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from openalign.config import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


def _copy_tokenizer(src: Path, dst: Path) -> bool:
    copied = False
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied = True
    return copied


def cmd_convert(args: argparse.Namespace) -> int:
    from openalign.model.hf import export_hf_align, load_hf_align
    from openalign.model.io import load_model, save_model

    src, out = Path(args.source), Path(args.out)
    if args.from_hf:
        model = load_hf_align(src)
        save_model(model, out)
        tok = _copy_tokenizer(src, out)
        print(f"wrote openalign checkpoint {out} ({model.config.embed_dim}-d{', with tokenizer' if tok else ''})")
    else:
        model = load_model(src)
        tokenizer_dir = args.tokenizer or (src if any((src / n).is_file() for n in TOKENIZER_FILES[:2]) else None)
        export_hf_align(model, out, tokenizer_dir=tokenizer_dir)
        print(f"wrote transformers AlignModel directory {out}{' with tokenizer' if tokenizer_dir else ''}")
    return 0


def cmd_bench_model(args: argparse.Namespace) -> int:
    from openalign.bench.model import BenchSettings, run_model_bench

    settings = BenchSettings(
        preset=args.preset,
        image_size=args.image_size,
        batch_size=args.batch_size,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        device=args.device,
        bf16=args.bf16,
        compile=args.compile,
        channels_last=args.channels_last,
        text_lengths=args.text_lengths,
        baseline=not args.no_baseline,
        json_path=args.json,
    )
    run_model_bench(settings)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="openalign",
        description="ALIGN image-text dual encoders: models, conversion and benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    convert = sub.add_parser(
        "convert",
        help="convert between openalign checkpoints and transformers AlignModel directories",
        description="Convert a model between the openalign checkpoint format and transformers' AlignModel.",
        epilog="examples:\n"
        "  openalign convert --from-hf ./align-base ./align-base-openalign\n"
        "  openalign convert --to-hf ./runs/b7-base/final ./b7-base-hf",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    way = convert.add_mutually_exclusive_group(required=True)
    way.add_argument("--from-hf", action="store_true", help="SOURCE is a transformers AlignModel directory")
    way.add_argument("--to-hf", action="store_true", help="SOURCE is an openalign checkpoint directory")
    convert.add_argument("source", metavar="SOURCE")
    convert.add_argument("out", metavar="OUT")
    convert.add_argument("--tokenizer", help="with --to-hf: tokenizer directory to include (default: SOURCE's)")
    convert.set_defaults(func=cmd_convert)

    bench = sub.add_parser("bench", help="benchmarks that print our figure beside a baseline from the same run")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    model = bench_sub.add_parser(
        "model",
        help="training throughput of a preset against transformers' AlignModel",
        description="Forward+backward pairs/s, step time, peak memory and model FLOP utilisation for our "
        "dual encoder and for transformers' AlignModel built from the same config, in one run.",
        epilog="examples:\n"
        "  openalign bench model --preset b0-tiny\n"
        "  openalign bench model --preset b3-mini --device cuda --bf16 --channels-last --compile --batch-size 64",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model.add_argument("--preset", default="b0-tiny", help="model preset (default b0-tiny)")
    model.add_argument("--image-size", type=int, default=None, help="square input size (default: the preset's)")
    model.add_argument("--batch-size", type=int, default=16)
    model.add_argument("--steps", type=int, default=5, help="timed steps per round")
    model.add_argument("--warmup", type=int, default=2, help="untimed steps per round")
    model.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best round counts")
    model.add_argument("--device", default="cpu", help="cpu or cuda")
    model.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU)")
    model.add_argument("--compile", action="store_true", help="torch.compile both models")
    model.add_argument("--channels-last", action="store_true", help="channels_last image tensors for both")
    model.add_argument(
        "--text-lengths",
        default="alt-text",
        choices=["alt-text", "full"],
        help="alt-text: captions of 6-32 tokens padded to 64 (default); full: every row uses all 64",
    )
    model.add_argument("--no-baseline", action="store_true", help="measure only our model")
    model.add_argument("--json", help="also write the results to this JSON file")
    model.set_defaults(func=cmd_bench_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, FileNotFoundError, ValueError, ImportError) as err:
        print(f"openalign {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
