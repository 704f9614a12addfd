"""``openalign index build | info``, ``openalign search`` and ``openalign serve``."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from openalign.cli import schema
from openalign.cli.options import Alias, Parser, add_config, data, print_config, str_value

if TYPE_CHECKING:
    from openalign.model.dual_encoder import DualEncoder
    from openalign.search.api import ServeConfig
    from openalign.search.build import BuildConfig
    from openalign.search.query import Searcher
    from openalign.text.tokenizer import Tokenizer

BUILD = "openalign.search.build:BuildConfig"
QUERY = "openalign.search.query:Query"
SERVE = "openalign.search.api:ServeConfig"
OTHER_MODEL_HELP = (
    "query with --model even when it is not the model that built the index (its fingerprint in index.json "
    "differs): rankings made with another model's embeddings are meaningless"
)


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("index", help="build and inspect search indexes over image and caption embeddings", build=_index)
    sub.add_parser(
        "search", help="query an index: text → image, image → image, image → text, image ± text", build=_search
    )
    sub.add_parser(
        "serve", help="HTTP search API and web page; without --index, a demo over the synthetic world", build=_serve
    )


def _index(parser: Parser) -> None:
    actions = parser.add_subparsers(dest="index_command", required=True, metavar="ACTION", parser_class=Parser)
    actions.add_parser(
        "build",
        help="embed images (and captions) into an index; resumable; adds new items to an existing index",
        build=_build,
    )
    actions.add_parser("info", help="print an index's size, structure and model", build=_info)


def _build(parser: Parser) -> None:
    parser.description = (
        "Embed every image of a folder (foo.jpg + optional foo.txt caption) or of WebDataset shards into INDEX: "
        "memory-mapped float32 vectors, Parquet metadata aligned with ids, thumbnails, and an approximate FAISS "
        "index above --exact-threshold vectors. An interrupted build resumes after its last finished chunk; "
        "running it again on a grown source adds only the new items."
    )
    parser.epilog = (
        "examples:\n"
        "  openalign index build --model runs/nano/final --images photos/ --out photos.index --captions\n"
        "  openalign index build --model runs/b3/final --images 'shards/{00000..00099}.tar' --out web.index \\\n"
        "      --captions --memory-budget-mb 4096\n"
        "  openalign index build --model runs/b3/final --images new_photos/ --out photos.index --captions  # add\n"
        "  openalign index build --embeddings emb.npy --metadata meta.parquet --out elsewhere.index\n"
        "  openalign index build --embeddings clip_out/ --out laion.index   # img_emb/, metadata/, text_emb/"
    )
    parser.add_argument("--model", help="openalign checkpoint or transformers AlignModel dir (with --embeddings: "
                        "optional, attached for text and image queries)")  # fmt: skip
    parser.add_argument("--images", help="image folder, or shards (dir of tars, brace range, glob)")
    parser.add_argument(
        "--embeddings",
        "--from-embeddings",
        dest="embeddings",
        help="instead of --images: embeddings made elsewhere, a .npy [N, D] (with --metadata) or a folder as "
        "clip-retrieval's inference writes (img_emb/, metadata/, optional text_emb/); above --exact-threshold "
        "vectors, one on-disk IVF-PQ index built a shard at a time (--ann.on_disk false: in memory)",
    )
    parser.add_argument("--metadata", help="with an --embeddings .npy: Parquet table, one row per embedding "
                        "(image_path, caption, url, key, ... columns)")  # fmt: skip
    parser.add_argument(
        "--image-root",
        help="with --embeddings: the folder the metadata's image paths lie in (relative ones start there); "
        "serve reads image files only inside it, and none without it",
    )
    parser.add_argument("--out", required=True, help="index directory (created, resumed or extended)")
    parser.add_argument("--tokenizer", help="tokenizer file or dir (default: the model's)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    aliases = [
        Alias((f"--{name.replace('_', '-')}",), f"ann.{name}", f"same as --ann.{name}", type=convert)
        for name, convert in [("kind", str_value), ("exact_threshold", None), ("memory_budget_mb", None),
                              ("nprobe", None), ("target_recall", None)]
    ]  # fmt: skip
    add_config(parser, schema.read(BUILD), aliases=aliases, config_help="YAML with build settings (ann: nested)")
    parser.set_defaults(func=run_build)


def _search_model(
    model: str, tokenizer: str | None, need_tokenizer: bool
) -> tuple[DualEncoder, Tokenizer | None, str | None]:
    import openalign

    loaded = openalign.load_model(model)
    try:
        tok = openalign.load_tokenizer(tokenizer or model, max_length=loaded.config.text.max_length)
    except FileNotFoundError:
        if need_tokenizer or tokenizer:
            raise
        return loaded, None, None
    return loaded, tok, str(Path(tokenizer or model).resolve())


def run_build(args: argparse.Namespace) -> int:
    from openalign.config import to_dict
    from openalign.outputs import check_writable
    from openalign.search.build import build_config, build_index

    cfg = build_config(data(args))
    if args.print_config:
        print_config(to_dict(cfg))
        return 0
    if (args.images is None) == (args.embeddings is None):
        raise ValueError("give either --images (to embed) or --embeddings (made elsewhere)")
    if (args.metadata or args.image_root) and not args.embeddings:
        raise ValueError("--metadata and --image-root go with --embeddings (--images records its own folder)")
    check_writable(args.out, what="index", directory=True)  # before the model loads and the images are embedded
    if args.embeddings:
        return _import(args, cfg)
    if not args.model:
        raise ValueError("--model is required to embed --images")
    model, tokenizer, tokenizer_path = _search_model(args.model, args.tokenizer, cfg.captions)
    stats = build_index(
        model,
        tokenizer,
        args.images,
        args.out,
        cfg,
        model_path=str(Path(args.model).resolve()),
        tokenizer_path=tokenizer_path,
        progress=not args.quiet,
    )
    skipped = ", ".join(f"{reason} {n}" for reason, n in sorted(stats.skipped.items()))
    print(
        f"{args.out}: +{stats.added_images} images (+{stats.added_captions} captions), now {stats.images} "
        f"images and {stats.captions} captions; {stats.already_indexed} already indexed; "
        f"skipped {sum(stats.skipped.values())}{f' ({skipped})' if skipped else ''}"
    )
    return 0


def _import(args: argparse.Namespace, cfg: BuildConfig) -> int:
    from openalign.search.imported import import_embeddings

    model_path = tokenizer_path = None
    model_dim = None
    if args.model:
        model, _, tokenizer_path = _search_model(args.model, args.tokenizer, cfg.captions)
        model_path, model_dim = str(Path(args.model).resolve()), model.embed_dim
    result = import_embeddings(
        args.embeddings,
        args.out,
        metadata=args.metadata,
        ann=cfg.ann,
        model_path=model_path,
        tokenizer_path=tokenizer_path,
        model_dim=model_dim,
        image_root=args.image_root,
    )
    note = f"; normalised {result.normalized} rows that were not unit length" if result.normalized else ""
    attached = "" if model_path else "; no model attached (query by embedding, or pass --model to search)"
    print(f"{args.out}: {result.images} images and {result.captions} captions from {args.embeddings}{note}{attached}")
    return 0


def _info(parser: Parser) -> None:
    parser.add_argument("index", metavar="INDEX")
    parser.set_defaults(func=run_info)


def run_info(args: argparse.Namespace) -> int:
    import json

    from openalign.search.catalog import SearchIndex

    index = SearchIndex.open(args.index)
    print(json.dumps({**index.summary(), "params": {m: s.params for m, s in index.stores.items()}}, indent=2))
    return 0


def query_schema() -> schema.Schema:
    """Query's fields but its decoded image: ``--image`` takes a file."""
    full = schema.read(QUERY)
    return schema.Schema(tuple(k for k in full.knobs if k.path not in ("image", "embedding")), full.sections)


def _search(parser: Parser) -> None:
    parser.description = (
        "Search INDEX with text, an image, or both: parts are L2-normalised, text weighted 2 and the image 1 (the "
        "paper's best), --minus texts subtracted, the sum renormalised."
    )
    parser.epilog = (
        "examples:\n"
        "  openalign search photos.index --text 'a red circle on water'\n"
        "  openalign search photos.index --image shoes.jpg --plus beige -k 20\n"
        "  openalign search photos.index --image street.jpg --minus cars --dedup 0.95\n"
        "  openalign search photos.index --image cat.jpg --modality text   # captions of similar images"
    )
    parser.add_argument("index", metavar="INDEX")
    parser.add_argument("--image", help="image file to query with")
    parser.add_argument("--embedding", help="query vector: a .npy of shape [D] or [1, D], or a JSON list of numbers")
    parser.add_argument("--model", help="model checkpoint (default: the one the index was built with)")
    parser.add_argument("--tokenizer", help="tokenizer (default: the index's)")
    parser.add_argument("--allow-other-model", action="store_true", help=OTHER_MODEL_HELP)
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    add_config(parser, query_schema(), aliases=[Alias(("-k",), "k", "number of results, 1-1000 (default 10)")])
    parser.set_defaults(func=run_search)


def run_search(args: argparse.Namespace) -> int:
    import json

    from openalign.config import from_dict, to_dict
    from openalign.search.query import Query

    query = from_dict(Query, data(args))
    if args.print_config:
        print_config({k: v for k, v in to_dict(query).items() if k not in ("image", "embedding")})
        return 0
    from openalign.data.sources import BadInput, read_file
    from openalign.data.transforms import decode_image
    from openalign.search.api import load_searcher

    if args.image:
        path = Path(args.image)
        if not path.exists():
            raise FileNotFoundError(f"{args.image}: no such image file")
        try:  # a device or a huge file is a one-line error, not a hang
            query.image = decode_image(read_file(path))
        except BadInput as err:
            raise ValueError(f"{args.image}: not a usable image ({err.reason})") from None
    if args.embedding:
        query.embedding = _read_embedding(args.embedding)
    searcher = load_searcher(args.index, args.model, args.tokenizer, allow_other_model=args.allow_other_model)
    hits = searcher.search(query)
    if args.json:
        print(json.dumps([{"id": h.id, "score": h.score, **h.row} for h in hits], indent=2))
        return 0
    for rank, hit in enumerate(hits, 1):
        where = hit.row.get("url") or hit.row.get("path") or hit.row.get("key") or ""
        print(f"{rank:4d}  {hit.score:7.4f}  id={hit.id:<8d} {hit.row.get('caption') or ''}  {where}".rstrip())
    return 0


def _read_embedding(spec: str) -> list[float]:
    """A query vector from a .npy file ([D] or [1, D]), or a JSON list of numbers given inline or in a file."""
    import json

    import numpy as np

    text = spec if spec.lstrip().startswith("[") else None
    if text is None:
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"{spec}: no such embedding file (or give a JSON list of numbers)")
        if path.suffix == ".npy":
            try:
                vector = np.load(path, allow_pickle=False)
            except (ValueError, OSError, EOFError) as err:
                raise ValueError(f"{spec}: not a NumPy .npy array ({err})") from None
        else:
            text = path.read_text()
    if text is not None:
        try:
            vector = np.asarray(json.loads(text), dtype=np.float64)
        except (ValueError, TypeError) as err:
            raise ValueError(f"--embedding {spec[:40]}: not a .npy file or a JSON list of numbers") from err
    if vector.ndim == 2 and vector.shape[0] == 1:
        vector = vector[0]
    if vector.ndim != 1 or vector.dtype.kind not in "fiu":
        raise ValueError(f"--embedding {spec[:40]}: expected one vector [D], got shape {list(vector.shape)}")
    return [float(x) for x in vector]


def _serve(parser: Parser) -> None:
    parser.description = (
        "Serve POST /search, GET /image/{id}, GET /health (OpenAPI at /docs), a search page at /, and "
        "clip-retrieval's POST /knn-service, GET /indices-list and POST /metadata. Without "
        "--index a demo index of synthetic scenes is built on first use (cached) with --model, or with an "
        "untrained nano model when none is given. With an API key (--api-key or $OPENALIGN_API_KEY) every route "
        "but /health needs 'Authorization: Bearer KEY' or 'X-API-Key: KEY'."
    )
    parser.epilog = (
        "examples:\n"
        "  openalign serve                                  # demo index, http://127.0.0.1:8000/\n"
        "  openalign serve --model runs/nano/final          # demo index embedded with a trained model\n"
        "  OPENALIGN_API_KEY=... openalign serve --index photos.index --host 0.0.0.0 --port 8080\n"
        "  openalign serve --index photos=photos.index --index web=web.index   # clip-retrieval: /knn-service"
    )
    parser.add_argument(
        "--index",
        action="append",
        metavar="[NAME=]PATH",
        help="index directory, named by its folder or NAME (repeat to serve several; the first is the default; "
        "default: the demo index)",
    )
    parser.add_argument("--model", help="model checkpoint (default: the index's; for the demo, an untrained nano)")
    parser.add_argument("--tokenizer", help="tokenizer (default: the index's)")
    parser.add_argument("--allow-other-model", action="store_true", help=OTHER_MODEL_HELP)
    add_config(parser, schema.read(SERVE))
    parser.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import os

    from openalign.config import ConfigError, from_dict, to_dict
    from openalign.search.api import ServeConfig, listen

    cfg = from_dict(ServeConfig, data(args))
    if cfg.api_key is None and os.environ.get("OPENALIGN_API_KEY"):
        cfg.api_key = os.environ["OPENALIGN_API_KEY"]
    cfg.validate()
    if not 0 <= cfg.port <= 65535:  # else uvicorn fails only once the app is up, with a traceback
        raise ConfigError(f"port must be in 0..65535, got {cfg.port}")
    if args.print_config:
        print_config({**to_dict(cfg), "api_key": "***" if cfg.api_key else None})
        return 0
    # The port is taken first: finding it in use should not wait for an index and a model to load.
    sock = listen(cfg.host, cfg.port)
    try:
        _run_serve(args, cfg, sock)
    finally:
        sock.close()
    return 0


def _run_serve(args: argparse.Namespace, cfg: ServeConfig, sock: socket.socket) -> None:
    from openalign.search.api import create_app, index_specs, load_searcher, load_searchers, serve
    from openalign.search.guard import exposure_warning

    warning = exposure_warning(cfg.host, cfg.api_key)
    if warning:
        print(warning, file=sys.stderr)
    index = args.index
    if index is None:
        from openalign.search.demo import build_demo_index, default_demo_dir

        out = Path(cfg.demo_dir) if cfg.demo_dir else default_demo_dir(cfg.demo_images, cfg.seed, args.model)
        print(f"serving the demo index in {out} (built on first use)", file=sys.stderr)
        index = build_demo_index(out, model_path=args.model, n_images=cfg.demo_images, seed=cfg.seed)
        searchers: Searcher | dict[str, Searcher] = load_searcher(index)
    else:
        searchers = load_searchers(
            index_specs(index), args.model, args.tokenizer, allow_other_model=args.allow_other_model
        )
    app = create_app(
        searchers,
        max_upload_bytes=int(cfg.max_upload_mb * 2**20),
        body_timeout_s=cfg.body_timeout_s,
        decode_budget_bytes=int(cfg.decode_budget_mb * 2**20),
        request_memory_bytes=int(cfg.request_memory_mb * 2**20),
        api_key=cfg.api_key,
        reload_check_s=cfg.reload_check_s,
    )
    port = sock.getsockname()[1]  # the one bound, when --port 0 asked for any free one
    print(f"openalign search on http://{cfg.host}:{port}/  (API docs at /docs)", file=sys.stderr)
    serve(app, host=cfg.host, port=port, log_level=cfg.log_level, sock=sock, limits=cfg.limits())
