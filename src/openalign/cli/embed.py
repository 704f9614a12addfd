"""``openalign embed``: images and captions of a crawl into clip-retrieval's inference layout, under torchrun."""

from __future__ import annotations

import argparse

from openalign.cli import schema
from openalign.cli.options import Parser, add_config, data, print_config

EMBED = "openalign.pipeline.embed_shards:EmbedShardsConfig"


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser(
        "embed",
        help="embed WebDataset shards or a table into img_emb/, text_emb/, metadata/ (clip-retrieval's layout); "
        "any number of processes under torchrun; resumable",
        build=_embed,
    )


def _embed(parser: Parser) -> None:
    parser.description = (
        "Embed the images and captions of SOURCE (WebDataset shards: a folder of .tar, a brace range or a glob; "
        "or a table .parquet/.csv/.jsonl with image bytes or an image_path column, cut into --table-chunk-rows "
        "parts) into OUT as clip-retrieval's inference writes it: img_emb/img_emb_NNNN.npy, "
        "text_emb/text_emb_NNNN.npy and metadata/metadata_NNNN.parquet, one triple per input part, numbered by "
        "the part. Under torchrun each process takes every WORLD_SIZE-th part, on cuda:LOCAL_RANK when there is "
        "CUDA. A restarted job skips the finished parts; unreadable images are skipped and counted per part in "
        "stats/. OUT/embed.json records the model's fingerprint and, once all parts are done, the totals."
    )
    parser.epilog = (
        "examples:\n"
        "  openalign embed 'shards/{00000..00999}.tar' emb/ --model runs/b3/final\n"
        "  torchrun --nproc_per_node 8 -m openalign embed 'shards/{00000..00999}.tar' emb/ --model runs/b3/final\n"
        "  openalign embed crawl.parquet emb/ --model kakaobrain/align-base --image-root images/\n"
        "  openalign embed 'shards/*.tar' dedup_emb/ --embedder copy-detector:copy_detector/ --no-captions\n"
        "  openalign index build --embeddings emb/ --out web.index --model runs/b3/final"
    )
    parser.add_argument("source", metavar="SOURCE", help="WebDataset shards, or a table (.parquet/.csv/.jsonl)")
    parser.add_argument("out", metavar="OUT", help="output folder (created; resumed when it holds a run)")
    parser.add_argument("--model", help="openalign checkpoint, transformers AlignModel dir or cached hub id")
    parser.add_argument("--embedder", help="instead of --model: copy-detector:DIR or align:DIR, as dedup takes")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_config(parser, schema.read(EMBED))
    parser.set_defaults(func=run_embed)


def run_embed(args: argparse.Namespace) -> int:
    import json

    from openalign.config import from_dict, to_dict
    from openalign.outputs import check_writable
    from openalign.pipeline.embed_shards import EmbedShardsConfig, Rank, embed_shards, load_embed_model, pick_device

    cfg = from_dict(EmbedShardsConfig, data(args))
    cfg.validate()
    if args.print_config:
        print_config(to_dict(cfg))
        return 0
    rank = Rank.from_env()
    check_writable(args.out, what="embedding folder", directory=True)  # before the model loads
    device = pick_device(cfg.device, rank)
    model = load_embed_model(args.model, args.embedder, device=device, captions=cfg.captions)
    result = embed_shards(args.source, args.out, model, cfg, rank=rank, progress=not args.quiet and rank.rank == 0)
    skipped = sum(result.skipped.values())
    print(
        f"rank {rank.rank}/{rank.world}: embedded {len(result.worked)} parts ({result.rows} rows, skipped "
        f"{skipped}{f' {json.dumps(result.skipped)}' if skipped else ''}); {len(result.already_done)} parts "
        "already done"
    )
    if result.complete:
        totals = result.totals
        print(
            f"{args.out}: all {result.parts} parts done: {totals['rows']} rows, skipped {json.dumps(totals['skipped'])}"
        )
    return 0
