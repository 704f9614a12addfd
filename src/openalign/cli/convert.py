"""``openalign convert``: between openalign checkpoints and transformers AlignModel directories."""

from __future__ import annotations

import argparse
from pathlib import Path

from openalign.cli.options import Parser


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser(
        "convert",
        help="convert between openalign checkpoints and transformers AlignModel directories",
        build=_build,
    )


def _build(parser: Parser) -> None:
    parser.description = "Convert a model between the openalign checkpoint format and transformers' AlignModel."
    parser.epilog = (
        "examples:\n"
        "  openalign convert --from-hf ./align-base ./align-base-openalign\n"
        "  openalign convert --to-hf ./runs/b7-base/final ./b7-base-hf"
    )
    way = parser.add_mutually_exclusive_group(required=True)
    way.add_argument("--from-hf", action="store_true", help="SOURCE is a transformers AlignModel directory")
    way.add_argument("--to-hf", action="store_true", help="SOURCE is an openalign checkpoint directory")
    parser.add_argument("source", metavar="SOURCE")
    parser.add_argument("out", metavar="OUT")
    parser.add_argument("--tokenizer", help="with --to-hf: tokenizer directory to include (default: SOURCE's)")
    parser.set_defaults(func=run)


def _copy_tokenizer(src: Path, dst: Path) -> bool:
    import shutil

    from openalign.data.sources import TOKENIZER_FILES

    copied = False
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied = True
    return copied


def run(args: argparse.Namespace) -> int:
    from openalign.data.sources import find_tokenizer_file
    from openalign.model.dual_encoder import DualEncoder
    from openalign.model.hf import export_hf_align, load_hf_align
    from openalign.model.io import load_model, save_model

    src, out = Path(args.source), Path(args.out)
    if args.from_hf:
        model = load_hf_align(src, DualEncoder)
        save_model(model, out)
        tok = _copy_tokenizer(src, out)
        print(f"wrote openalign checkpoint {out} ({model.config.embed_dim}-d{', with tokenizer' if tok else ''})")
    else:
        model = load_model(src)
        tokenizer_dir = args.tokenizer or (src if find_tokenizer_file(src) else None)
        export_hf_align(model, out, tokenizer_dir=tokenizer_dir)
        print(f"wrote transformers AlignModel directory {out}{' with tokenizer' if tokenizer_dir else ''}")
    return 0
