"""``openalign <command>``: parses arguments, checks them, and calls the library. Nothing else lives here."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

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
        memory_format="channels_last" if args.channels_last else args.memory_format.replace("-", "_"),
        text_lengths=args.text_lengths,
        baseline=not args.no_baseline,
        json_path=args.json,
    )
    run_model_bench(settings)
    return 0


def _eval_task_parser(task: Any) -> argparse.ArgumentParser:
    """Flags for one eval task, built from its declared options (``openalign.eval.tasks.Option``)."""
    examples = "".join(f"  {line}\n" for line in task.examples)
    parser = argparse.ArgumentParser(
        prog=f"openalign eval {task.name}",
        description=task.description or task.help,
        epilog=f"examples:\n{examples}" if examples else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="openalign checkpoint or transformers AlignModel directory")
    parser.add_argument("--tokenizer", help="tokenizer file or directory (default: the model directory)")
    parser.add_argument("--out", help="directory for <task>-<dataset>.json and results.md (default: print only)")
    for option in task.all_options():
        kwargs: dict[str, Any] = {"dest": option.name, "default": None, "help": option.help}
        if option.required:
            kwargs["required"] = True
        if option.type is bool:
            kwargs["action"] = "store_false" if option.default is True else "store_true"
        elif option.type is list:
            kwargs.update(nargs="+", metavar=option.metavar or option.name.upper())
        else:
            kwargs.update(type=option.type, choices=option.choices, metavar=option.metavar)
        parser.add_argument(option.flag, **kwargs)
    return parser


def _eval_overview() -> str:
    from openalign.eval.tasks import load_tasks

    lines = [
        "usage: openalign eval TASK --model CKPT [options] [--out DIR]",
        "       openalign eval suite SUITE.yaml [--model CKPT] [--out DIR] [--resume]",
        "",
        "Evaluate a model the way the ALIGN paper does; `openalign eval TASK --help` lists a task's options.",
        "",
        "tasks:",
    ]
    tasks = load_tasks()
    width = max([len(n) for n in tasks] + [5])
    lines += [f"  {name:<{width}}  {tasks[name].help}" for name in sorted(tasks)]
    lines += [f"  {'suite':<{width}}  run the tasks listed in a YAML file, loading the model once"]
    lines += ["", "examples:"]
    lines += [f"  {ex}" for name in sorted(tasks) for ex in tasks[name].examples[:1]]
    lines += ["  openalign eval suite suite.yaml --model runs/nano/final --out results/"]
    return "\n".join(lines)


def cmd_eval(args: argparse.Namespace) -> int:
    rest = list(args.rest)
    if args.task is None or args.help or args.task in ("-h", "--help"):
        if args.task and args.task not in ("-h", "--help"):
            rest.append("--help")
        elif args.help or args.task:
            print(_eval_overview())
            return 0
        else:
            print(_eval_overview(), file=sys.stderr)
            print("openalign eval: error: name a TASK (or suite)", file=sys.stderr)
            return 2
    if args.task == "suite":
        from openalign.eval.suite import run_suite

        suite = argparse.ArgumentParser(
            prog="openalign eval suite",
            description="Run every task of a suite YAML on one model; results are written after each task.",
            epilog="example suite.yaml:\n"
            "  model: runs/nano/final\n"
            "  out: results/nano\n"
            "  tasks:\n"
            "    - {task: retrieval, name: flickr30k, dataset: karpathy:dataset_flickr30k.json, images: flickr30k}\n"
            "    - {task: zeroshot, dataset: imagenet/val, layout: imagenet}\n\n"
            "examples:\n"
            "  openalign eval suite suite.yaml\n"
            "  openalign eval suite suite.yaml --model runs/b0-tiny/final --out results/b0 --resume",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        suite.add_argument("suite", metavar="SUITE.yaml")
        suite.add_argument("--model", help="checkpoint directory (overrides the YAML's model)")
        suite.add_argument("--tokenizer", help="tokenizer file or directory (default: the model directory)")
        suite.add_argument("--out", help="results directory (overrides the YAML's out)")
        suite.add_argument("--device", help="torch device for every task (overrides the YAML)")
        suite.add_argument("--resume", action="store_true", help="skip tasks whose results are already in --out")
        ns = suite.parse_args(rest)
        summary = run_suite(
            ns.suite, model=ns.model, tokenizer=ns.tokenizer, out=ns.out, device=ns.device, resume=ns.resume
        )
        print(summary.markdown)
        if summary.failed:
            print(
                f"openalign eval: error: {len(summary.failed)} task(s) failed: {'; '.join(summary.failed)}",
                file=sys.stderr,
            )
            return 1
        return 0

    from openalign.eval.suite import run_eval
    from openalign.eval.tasks import get_task

    task = get_task(args.task)
    ns = _eval_task_parser(task).parse_args(rest)
    options = {o.name: getattr(ns, o.name) for o in task.all_options() if getattr(ns, o.name) is not None}
    _, markdown = run_eval(task.name, ns.model, options, tokenizer=ns.tokenizer, out=ns.out)
    print(markdown)
    return 0


def cmd_shard(args: argparse.Namespace) -> int:
    from openalign.data.shards import shard_input

    totals = shard_input(
        args.input,
        args.out,
        samples_per_shard=args.samples_per_shard,
        max_side=args.max_side,
        jpeg_quality=args.jpeg_quality,
        prefix=args.prefix,
        captions=args.captions,
        image_root=args.image_root,
        caption_column=args.caption_column,
        image_column=args.image_column,
        progress=not args.quiet,
    )
    skipped = ", ".join(f"{reason} {n}" for reason, n in totals["failures"].items())
    print(
        f"wrote {totals['successes']} samples in {totals['shards']} shards ({totals['bytes'] / 1e6:.1f} MB) to "
        f"{args.out}; skipped {totals['failed']}{f' ({skipped})' if skipped else ''}"
    )
    return 0


def _search_model(model: str | None, tokenizer: str | None, need_tokenizer: bool) -> tuple[Any, Any, str | None]:
    import openalign

    loaded = openalign.load_model(model)
    try:
        tok = openalign.load_tokenizer(tokenizer or model, max_length=loaded.config.text.max_length)
    except FileNotFoundError:
        if need_tokenizer or tokenizer:
            raise
        return loaded, None, None
    return loaded, tok, str(Path(tokenizer or model).resolve())


def cmd_index_build(args: argparse.Namespace) -> int:
    from openalign.config import load_yaml, merge
    from openalign.search.build import build_config, build_index

    data = load_yaml(args.config) if args.config else {}
    flags = {
        "captions": args.captions or None,
        "chunk_size": args.chunk_size,
        "batch_size": args.batch_size,
        "thumbnail_size": args.thumbnail_size,
        "device": args.device,
        "ann.kind": args.kind,
        "ann.exact_threshold": args.exact_threshold,
        "ann.memory_budget_mb": args.memory_budget_mb,
        "ann.nprobe": args.nprobe,
        "ann.target_recall": args.target_recall,
    }
    cfg = build_config(merge(data, {k: v for k, v in flags.items() if v is not None}))
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
    skipped = ", ".join(f"{reason} {n}" for reason, n in sorted(stats["skipped"].items()))
    print(
        f"{args.out}: +{stats['added_images']} images (+{stats['added_captions']} captions), now {stats['images']} "
        f"images and {stats['captions']} captions; {stats['already_indexed']} already indexed; "
        f"skipped {sum(stats['skipped'].values())}{f' ({skipped})' if skipped else ''}"
    )
    return 0


def cmd_index_info(args: argparse.Namespace) -> int:
    import json

    from openalign.search.catalog import SearchIndex

    index = SearchIndex.open(args.index)
    print(json.dumps({**index.summary(), "params": {m: s.params for m, s in index.stores.items()}}, indent=2))
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    import json

    from PIL import Image

    from openalign.data.transforms import decode_image
    from openalign.search.api import load_searcher
    from openalign.search.query import Query

    image = None
    if args.image:
        path = Path(args.image)
        if not path.is_file():
            raise FileNotFoundError(f"{args.image}: no such image file")
        image = decode_image(path.read_bytes())
    searcher = load_searcher(args.index, args.model, args.tokenizer)
    query = Query(
        text=args.text,
        image=image if isinstance(image, Image.Image) else None,
        image_id=args.image_id,
        plus=args.plus,
        minus=args.minus,
        k=args.k,
        modality=args.modality,
        text_weight=args.text_weight,
        image_weight=args.image_weight,
        dedup=args.dedup,
    )
    hits = searcher.search(query)
    if args.json:
        print(json.dumps([{"id": h.id, "score": h.score, **h.row} for h in hits], indent=2))
        return 0
    for rank, hit in enumerate(hits, 1):
        where = hit.row.get("url") or hit.row.get("path") or hit.row.get("key") or ""
        print(f"{rank:4d}  {hit.score:7.4f}  id={hit.id:<8d} {hit.row.get('caption') or ''}  {where}".rstrip())
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from openalign.search.api import create_app, load_searcher, serve

    if args.max_upload_mb <= 0:
        raise ValueError(f"--max-upload-mb must be positive, got {args.max_upload_mb}")
    index = args.index
    if index is None:
        from openalign.search.demo import build_demo_index, default_demo_dir

        out = Path(args.demo_dir) if args.demo_dir else default_demo_dir(args.demo_images, args.seed, args.model)
        print(f"serving the demo index in {out} (built on first use)", file=sys.stderr)
        index = build_demo_index(out, model_path=args.model, n_images=args.demo_images, seed=args.seed)
        searcher = load_searcher(index)
    else:
        searcher = load_searcher(index, args.model, args.tokenizer)
    app = create_app(searcher, max_upload_bytes=int(args.max_upload_mb * 2**20))
    print(f"openalign search on http://{args.host}:{args.port}/  (API docs at /docs)", file=sys.stderr)
    serve(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def cmd_bench_search(args: argparse.Namespace) -> int:
    from openalign.bench.search import SearchBenchSettings, run_search_bench

    settings = SearchBenchSettings(
        n=args.n,
        dim=args.dim,
        queries=args.queries,
        exact_queries=args.exact_queries,
        k=args.k,
        kind=args.kind,
        memory_budget_mb=args.memory_budget_mb,
        target_recall=args.target_recall,
        seed=args.seed,
        json_path=args.json,
    )
    run_search_bench(settings)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from openalign.bench.search import ServeBenchSettings, run_serve_bench

    result = run_serve_bench(
        ServeBenchSettings(
            index=args.index, clients=args.clients, requests=args.requests, k=args.k, json_path=args.json
        )
    )
    return 0 if result["server_errors"] == 0 and result["server_alive_after"] else 1


def cmd_bench_train(args: argparse.Namespace) -> int:
    from openalign.bench.train import TrainBenchSettings, run_train_bench

    settings = TrainBenchSettings(
        preset=args.preset,
        image_size=args.image_size,
        batch_size=args.batch_size,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        workers=args.workers,
        device=args.device,
        bf16=args.bf16,
        shard_samples=args.shard_samples,
        pipeline_samples=args.pipeline_samples,
        baseline=not args.no_baseline,
        json_path=args.json,
    )
    run_train_bench(settings)
    return 0


class _OverridesParser(argparse.ArgumentParser):
    """Keeps the ``--section.key VALUE`` pairs it does not know, in order, in ``args.overrides``."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def,override]
        namespace, extra = super().parse_known_args(args, namespace)
        namespace.overrides = [*getattr(namespace, "overrides", []), *extra]
        return namespace, []


def cmd_train(args: argparse.Namespace) -> int:
    from openalign.train.config import load_train_config, parse_overrides
    from openalign.train.loop import NonFiniteError, train

    cfg = load_train_config(args.config, parse_overrides(args.overrides))
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    try:
        result = train(cfg, resume=args.resume)
    except NonFiniteError as err:
        print(f"openalign train: error: {err}", file=sys.stderr)
        return 3
    print(f"trained {result.step} steps; model: {result.final_dir}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from openalign.train.logging import plot_metrics

    print(f"wrote {plot_metrics(args.run_dir, args.out)}")
    return 0


def _dedup_config(args: argparse.Namespace) -> Any:
    from openalign.config import from_dict, load_yaml, merge
    from openalign.data.dedup import DedupConfig

    flags = ("clusters", "nearest", "combo", "threshold", "seed", "engine", "project_dim", "chunk_size")
    overrides = {name: getattr(args, name) for name in flags if getattr(args, name, None) is not None}
    cfg = from_dict(DedupConfig, merge(load_yaml(args.config) if args.config else {}, overrides), "dedup")
    cfg.validate()
    return cfg


def cmd_dedup(args: argparse.Namespace) -> int:
    from openalign.data.dedup import run_dedup

    result, paths = run_dedup(
        args.train,
        args.test,
        args.out,
        _dedup_config(args),
        model_path=args.model,
        train_keys=args.train_keys,
        test_keys=args.test_keys,
        metadata=args.metadata,
        key_column=args.key_column,
        batch_size=args.batch_size,
        device=args.device,
        progress=not args.quiet,
    )
    st = result.stats
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    print(
        f"{st['train_n']:,} train × {st['test_n']:,} test images, {st.get('clusters', 0)} clusters: "
        f"{st['candidate_pairs']:,} candidate pairs, {st['duplicate_pairs']:,} near-duplicate pairs, "
        f"{st['train_rows_removed']:,} train images to drop"
    )
    if "metadata" in st:
        m = st["metadata"]
        print(f"metadata: {m['rows_in']:,} rows in, {m['rows_removed']:,} removed, {m['rows_out']:,} out")
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0


def cmd_vocab(args: argparse.Namespace) -> int:
    from openalign.text.vocab import VocabConfig, build_vocab

    cfg = VocabConfig(
        vocab_size=args.vocab_size,
        column=args.column,
        lowercase=args.lowercase,
        min_frequency=args.min_frequency,
        max_length=args.max_length,
    )
    tokenizer, stats = build_vocab(args.input, args.out, cfg, progress=not args.quiet)
    skipped = sum(stats["skipped"].values())
    print(
        f"{stats['captions']:,} captions ({skipped:,} skipped{': ' + str(stats['skipped']) if skipped else ''}) "
        f"-> {tokenizer.vocab_size:,} wordpieces in {args.out}"
    )
    return 0


def cmd_bench_dedup(args: argparse.Namespace) -> int:
    from openalign.bench.dedup import DedupBenchSettings, run_dedup_bench

    settings = DedupBenchSettings(
        train=args.train,
        test=args.test,
        dim=args.dim,
        brute_train=args.brute_train,
        seed=args.seed,
        json_path=args.json,
        dedup=_dedup_config(args),
    )
    if min(settings.train, settings.test, settings.dim, settings.brute_train) < 1:
        raise ValueError("--train, --test, --dim and --brute-train must be positive")
    run_dedup_bench(settings)
    return 0


def _add_dedup_flags(parser: argparse.ArgumentParser, with_seed: bool = True) -> None:
    parser.add_argument("--config", help="YAML file of dedup settings (flags override it)")
    parser.add_argument("--clusters", type=int, help="k-means clusters K (default 4096, the paper's 4K)")
    parser.add_argument("--nearest", type=int, help="nearest clusters per image (default 10)")
    parser.add_argument("--combo", type=int, help="clusters per bucket (default 3: C(10,3) = 120 buckets)")
    parser.add_argument("--threshold", type=float, help="cosine above which a pair is a duplicate (default 0.975)")
    if with_seed:
        parser.add_argument("--seed", type=int, help="k-means seed (default 0)")
    parser.add_argument("--engine", choices=["duckdb", "sparse", "numpy"], help="bucket join (default duckdb)")
    parser.add_argument("--project-dim", type=int, help="PCA width for clustering, 0 = none (default 64)")
    parser.add_argument("--chunk-size", type=int, help="train rows per join chunk (default 131072)")


def _key_values(items: list[str] | None, flag: str) -> dict[str, object]:
    from openalign.config import parse_yaml

    out: dict[str, object] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} expects KEY=VALUE, got '{item}'")
        out[key.strip()] = parse_yaml(value) if value.strip() else None
    return out


def cmd_filter(args: argparse.Namespace) -> int:
    from openalign.data.filters import EngineConfig, filter_corpus, load_rules

    overrides = _key_values(args.set, "--set")
    if args.text_column:
        overrides["columns.text"] = args.text_column
    rules = load_rules(args.rules, **overrides)
    engine = EngineConfig(
        engine=args.engine,
        threads=args.threads,
        memory_limit=args.memory_limit,
        temp_directory=args.temp_dir,
        spark_master=args.spark_master,
        spark_conf={k: str(v) for k, v in _key_values(args.spark_conf, "--spark-conf").items()},
    )
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be positive, got {args.threads}")
    report = filter_corpus(
        args.input,
        args.output,
        rules,
        engine=engine,
        input_format=args.input_format,
        report_path=args.report,
        person_hook=args.person_names,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    print(report.table())
    print(f"wrote {args.output}" + (f" and {args.report}" if args.report else ""))
    return 0


def cmd_bench_retrieval(args: argparse.Namespace) -> int:
    from openalign.bench.retrieval import RetrievalBenchSettings, run_retrieval_bench

    run_retrieval_bench(
        RetrievalBenchSettings(
            images=args.images,
            captions_per_image=args.captions_per_image,
            dim=args.dim,
            noise=None if args.independent else args.noise,
            rounds=args.rounds,
            seed=args.seed,
            json_path=args.json,
        )
    )
    return 0


def cmd_bench_filter(args: argparse.Namespace) -> int:
    from openalign.bench.filter import run_filter_bench

    result = run_filter_bench(
        args.rows, args.baseline_rows, seed=args.seed, threads=args.threads, top_k=args.top_k, work_dir=args.work_dir
    )
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from openalign.demo import DemoConfig, quick_config, run_demo, run_demo_seeds

    cfg = quick_config(args.out) if args.quick else DemoConfig(out=args.out)
    cfg.seed = args.seed
    if args.corpus_size is not None:
        cfg.corpus_size = args.corpus_size
    if args.steps is not None:
        cfg.train_steps = args.steps
    if args.seeds > 1:
        run_demo_seeds(cfg, args.seeds)
    else:
        run_demo(cfg)
    return 0


def cmd_experiments(args: argparse.Namespace) -> int:
    from openalign.experiments import ExperimentSettings, parse_only, quick_settings, run_experiments

    settings = quick_settings(args.out) if args.quick else ExperimentSettings(out=args.out)
    if args.only is not None:
        settings.only = parse_only(args.only)
    settings.seeds = args.seeds
    if args.steps is not None:
        settings.steps = args.steps
    run_experiments(settings)
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

    evaluate = sub.add_parser(
        "eval",
        help="evaluate a model: retrieval, zero-shot classification, KNN, ... or a suite of them",
        add_help=False,
    )
    evaluate.add_argument("-h", "--help", action="store_true")
    evaluate.add_argument("task", nargs="?", metavar="TASK")
    evaluate.add_argument("rest", nargs=argparse.REMAINDER)
    evaluate.set_defaults(func=cmd_eval)

    shard = sub.add_parser(
        "shard",
        help="write images and captions as WebDataset shards (img2dataset layout)",
        description="Write WebDataset tars (key.jpg / key.txt / key.json, a NNNNN_stats.json per shard) from an "
        "image folder with captions, a Parquet table with an image-bytes column, or a metadata table "
        "(Parquet/CSV/JSONL, e.g. the output of `openalign filter`) whose image_path column points to files. "
        "Every metadata column is kept in key.json; unreadable images are skipped and counted by reason.",
        epilog="examples:\n"
        "  openalign shard photos/ shards/                       # photos/cat.jpg + photos/cat.txt ...\n"
        "  openalign shard photos/ shards/ --captions captions.csv --max-side 512\n"
        "  openalign shard pairs.parquet shards/ --image-column jpg --caption-column text\n"
        "  openalign shard corpus/filtered.parquet shards/ --image-root corpus --samples-per-shard 10000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    shard.add_argument("input", metavar="INPUT", help="image folder, or .parquet/.csv/.tsv/.jsonl table")
    shard.add_argument("out", metavar="OUT", help="output folder for the shards")
    shard.add_argument("--max-side", type=int, default=None, help="downscale so the longer side is at most N px")
    shard.add_argument("--jpeg-quality", type=int, default=95, help="JPEG quality 1-100 (default 95)")
    shard.add_argument("--samples-per-shard", type=int, default=1000, help="samples per tar (default 1000)")
    shard.add_argument("--prefix", default="", help="shard file name prefix, e.g. train- (default none)")
    shard.add_argument("--captions", help="folder input: CSV/Parquet/JSONL of file name + caption (else sidecar .txt)")
    shard.add_argument("--image-root", help="table input: folder that relative image_path values start from "
                       "(default: the table's folder)")  # fmt: skip
    shard.add_argument("--caption-column", help="table input: caption column (default: caption, text, alt, ...)")
    shard.add_argument("--image-column", help="table input: image-bytes column (default: jpg, image, image_bytes, ...)")
    shard.add_argument("--quiet", action="store_true", help="no progress bar")
    shard.set_defaults(func=cmd_shard)

    filt = sub.add_parser(
        "filter",
        help="filter noisy alt-text pairs with the ALIGN (or CC12M) rules; prints the funnel",
        description="Apply ALIGN's frequency-based image and text filters (or CC12M's relaxed ones) to "
        "img2dataset-style metadata: Parquet, CSV/TSV, JSON Lines or WebDataset shards with url/key, a "
        "caption column, width, height and optional sha256 and unsafe score. Writes the surviving rows with "
        "every input column (format by OUTPUT's extension; with --engine spark a directory of part files) "
        "and prints the funnel: rows in, rows removed by each rule in order, rows out.",
        epilog="examples:\n"
        "  openalign filter pairs.parquet kept.parquet --report funnel.json\n"
        "  openalign filter pairs.csv kept.jsonl --rules cc12m --person-names demo\n"
        "  openalign filter 'shards/{00000..00009}.tar' kept.parquet --set vocab_top_k=1000000 --set max_words=30\n"
        "  openalign filter 'parts/*.parquet' kept.parquet --engine spark --spark-master spark://head:7077\n"
        "  openalign filter pairs.parquet kept.parquet --rules my_rules.yaml   # YAML: preset: align, max_words: 30",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    filt.add_argument("input", metavar="INPUT", help="file, directory, glob, or WebDataset shard spec")
    filt.add_argument("output", metavar="OUTPUT", help=".parquet, .csv, .tsv or .jsonl")
    filt.add_argument("--rules", default="align", help="align (default), cc12m, or a RULES.yaml")
    filt.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a rule field (repeatable)")
    filt.add_argument("--engine", default="duckdb", choices=["duckdb", "spark"], help="default duckdb")
    filt.add_argument("--report", metavar="REPORT.json", help="write the funnel and statistics as JSON")
    filt.add_argument("--input-format", choices=["parquet", "csv", "tsv", "jsonl", "webdataset"], help="default: auto")
    filt.add_argument("--text-column", help="alt-text column (default: first of caption, alt, alt_text, text, TEXT)")
    filt.add_argument("--person-names", metavar="HOOK", help="names -> <PERSON> after filtering: demo or module:func")
    filt.add_argument("--threads", type=int, help="duckdb: threads (default: all cores)")
    filt.add_argument("--memory-limit", help="duckdb: memory before spilling to disk, e.g. 8GB")
    filt.add_argument("--temp-dir", help="work files and spill directory (default: system temp)")
    filt.add_argument("--spark-master", default="local[*]", help="spark: master URL (default local[*])")
    filt.add_argument("--spark-conf", action="append", metavar="KEY=VALUE", help="spark: extra setting (repeatable)")
    filt.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    filt.add_argument("--quiet", action="store_true", help="no progress lines")
    filt.set_defaults(func=cmd_filter)

    dedup = sub.add_parser(
        "dedup",
        help="find training images that near-duplicate test images (the ALIGN supplement) and drop them",
        description="k-means clusters on the train embeddings; each image's nearest clusters; every "
        "combination of COMBO of them is a bucket; train/test pairs sharing a bucket are compared, and a "
        "pair with cosine > THRESHOLD is a near-duplicate. Writes duplicates.parquet (every pair), "
        "drop.parquet + drop.json (train images to remove), stats.json and, with --metadata, the table "
        "without those images. TRAIN/TEST are .npy embeddings, or with --model image folders or shards.",
        epilog="examples:\n"
        "  openalign dedup train.npy test.npy dedup/ --train-keys train_keys.txt --metadata filtered.parquet\n"
        "  openalign dedup 'shards/{00000..00099}.tar' eval_images/ dedup/ --model runs/b3/final\n"
        "  openalign dedup train.npy test.npy dedup/ --clusters 1024 --engine sparse",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    dedup.add_argument("train", metavar="TRAIN", help="train embeddings .npy, or (--model) image folder / shards")
    dedup.add_argument("test", metavar="TEST", help="test embeddings .npy, or (--model) image folder / shards")
    dedup.add_argument("out", metavar="OUT_DIR")
    _add_dedup_flags(dedup)
    dedup.add_argument("--model", help="openalign checkpoint (or transformers AlignModel dir) to embed images")
    dedup.add_argument("--train-keys", help="keys of the train rows: .txt (one per line), .json list, or table")
    dedup.add_argument("--test-keys", help="keys of the test rows, same formats")
    dedup.add_argument("--metadata", help="train metadata table (.parquet/.csv/.jsonl) to write without duplicates")
    dedup.add_argument("--key-column", default="key", help="metadata column matching the train keys (default key)")
    dedup.add_argument("--batch-size", type=int, default=64, help="with --model: images per batch")
    dedup.add_argument("--device", default="cpu", help="with --model: cpu or cuda")
    dedup.add_argument("--quiet", action="store_true", help="no progress bars")
    dedup.set_defaults(func=cmd_dedup)

    vocab = sub.add_parser(
        "vocab",
        help="train the WordPiece vocabulary on alt-texts (HF tokenizers; loads in transformers too)",
        description="Learn a BERT WordPiece vocabulary from captions streamed from Parquet, CSV, JSON Lines, plain "
        "text (one caption per line) or WebDataset shards (txt members). Writes tokenizer.json, vocab.txt, "
        "tokenizer_config.json, special_tokens_map.json and vocab_stats.json; null, empty and non-UTF-8 "
        "captions are skipped and counted.",
        epilog="examples:\n"
        "  openalign vocab corpus/filtered.parquet vocab/\n"
        "  openalign vocab captions.txt vocab/ --vocab-size 32000 --min-frequency 5\n"
        "  openalign vocab 'shards/{00000..00099}.tar' vocab/ --no-lowercase",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    vocab.add_argument("input", metavar="INPUT", help=".parquet (file or folder), .csv, .jsonl, .txt, or shards")
    vocab.add_argument("out", metavar="OUT_DIR")
    vocab.add_argument("--vocab-size", type=int, default=100_000, help="wordpieces (default 100000, the paper's)")
    vocab.add_argument("--column", default="caption", help="caption column of a table (default caption)")
    vocab.add_argument(
        "--lowercase",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="BERT-uncased normalisation: lowercase and strip accents (default); --no-lowercase keeps both",
    )
    vocab.add_argument("--min-frequency", type=int, default=2, help="minimum count of a merge (default 2)")
    vocab.add_argument("--max-length", type=int, default=64, help="tokens per caption (default 64, the paper's)")
    vocab.add_argument("--quiet", action="store_true", help="no progress bar")
    vocab.set_defaults(func=cmd_vocab)

    index = sub.add_parser("index", help="build and inspect search indexes over image and caption embeddings")
    index_sub = index.add_subparsers(dest="index_command", required=True, metavar="ACTION")
    index_build = index_sub.add_parser(
        "build",
        help="embed images (and captions) into an index; resumable; adds new items to an existing index",
        description="Embed every image of a folder (foo.jpg + optional foo.txt caption) or of WebDataset shards "
        "into INDEX: memory-mapped float32 vectors, Parquet metadata aligned with ids, thumbnails, and an "
        "approximate FAISS index above --exact-threshold vectors. An interrupted build resumes after its last "
        "finished chunk; running it again on a grown source adds only the new items.",
        epilog="examples:\n"
        "  openalign index build --model runs/nano/final --images photos/ --out photos.index --captions\n"
        "  openalign index build --model runs/b3/final --images 'shards/{00000..00099}.tar' --out web.index \\\n"
        "      --captions --memory-budget-mb 4096\n"
        "  openalign index build --model runs/b3/final --images new_photos/ --out photos.index --captions  # add",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    index_build.add_argument("--model", required=True, help="openalign checkpoint or transformers AlignModel dir")
    index_build.add_argument("--images", required=True, help="image folder, or shards (dir of tars, brace range, glob)")
    index_build.add_argument("--out", required=True, help="index directory (created, resumed or extended)")
    index_build.add_argument("--captions", action="store_true", help="also index captions (image → text search)")
    index_build.add_argument("--tokenizer", help="tokenizer file or dir (default: the model's)")
    index_build.add_argument("--config", help="YAML with build settings (keys of BuildConfig, ann: nested)")
    index_build.add_argument("--chunk-size", type=int, help="items per resumable chunk (default 1024)")
    index_build.add_argument("--batch-size", type=int, help="images per forward pass (default 64)")
    index_build.add_argument("--thumbnail-size", type=int, help="stored thumbnail side in px, 0 for none (default 256)")
    index_build.add_argument("--device", help="cpu or cuda (default cpu)")
    index_build.add_argument(
        "--kind", choices=["auto", "exact", "ivf_flat", "ivf_pq", "hnsw"], help="search structure (default auto)"
    )
    index_build.add_argument("--exact-threshold", type=int, help="auto: exact search up to N vectors (default 100000)")
    index_build.add_argument("--memory-budget-mb", type=float, help="auto: RAM for the ANN index (default 8192)")
    index_build.add_argument("--nprobe", type=int, help="IVF lists probed (default: calibrated to --target-recall)")
    index_build.add_argument("--target-recall", type=float, help="recall@10 calibration aims for (default 0.95)")
    index_build.add_argument("--quiet", action="store_true", help="no progress bar")
    index_build.set_defaults(func=cmd_index_build)
    index_info = index_sub.add_parser("info", help="print an index's size, structure and model")
    index_info.add_argument("index", metavar="INDEX")
    index_info.set_defaults(func=cmd_index_info)

    search = sub.add_parser(
        "search",
        help="query an index: text → image, image → image, image → text, image ± text",
        description="Search INDEX with text, an image, or both: parts are L2-normalised, text weighted 2 and the "
        "image 1 (the paper's best), --minus texts subtracted, the sum renormalised.",
        epilog="examples:\n"
        "  openalign search photos.index --text 'a red circle on water'\n"
        "  openalign search photos.index --image shoes.jpg --plus beige -k 20\n"
        "  openalign search photos.index --image street.jpg --minus cars --dedup 0.95\n"
        "  openalign search photos.index --image cat.jpg --modality text   # captions of similar images",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    search.add_argument("index", metavar="INDEX")
    search.add_argument("--text", help="text query")
    search.add_argument("--image", help="image file to query with")
    search.add_argument("--image-id", type=int, help="query with an indexed image (its id)")
    search.add_argument("--plus", action="append", default=[], metavar="TEXT", help="text to add (repeatable)")
    search.add_argument("--minus", action="append", default=[], metavar="TEXT", help="text to subtract (repeatable)")
    search.add_argument("-k", type=int, default=10, help="number of results, 1-1000 (default 10)")
    search.add_argument("--modality", choices=["image", "text"], default="image", help="search images or captions")
    search.add_argument("--text-weight", type=float, default=2.0, help="weight of each text part (default 2)")
    search.add_argument("--image-weight", type=float, default=1.0, help="weight of the image part (default 1)")
    search.add_argument("--dedup", type=float, help="drop results with cosine above this to a better one")
    search.add_argument("--model", help="model checkpoint (default: the one the index was built with)")
    search.add_argument("--tokenizer", help="tokenizer (default: the index's)")
    search.add_argument("--json", action="store_true", help="print results as JSON")
    search.set_defaults(func=cmd_search)

    serve = sub.add_parser(
        "serve",
        help="HTTP search API and web page; without --index, a demo over the synthetic world",
        description="Serve POST /search, GET /image/{id}, GET /health (OpenAPI at /docs) and a search page at /. "
        "Without --index a demo index of synthetic scenes is built on first use (cached) with --model, or with an "
        "untrained nano model when none is given.",
        epilog="examples:\n"
        "  openalign serve                                  # demo index, http://127.0.0.1:8000/\n"
        "  openalign serve --model runs/nano/final          # demo index embedded with a trained model\n"
        "  openalign serve --index photos.index --host 0.0.0.0 --port 8080",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--index", help="index directory (default: the demo index)")
    serve.add_argument("--model", help="model checkpoint (default: the index's; for the demo, an untrained nano)")
    serve.add_argument("--tokenizer", help="tokenizer (default: the index's)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-upload-mb", type=float, default=8.0, help="largest accepted query image (default 8)")
    serve.add_argument("--demo-images", type=int, default=500, help="demo: number of synthetic images (default 500)")
    serve.add_argument("--demo-dir", help="demo: where to build and cache the index")
    serve.add_argument("--seed", type=int, default=0, help="demo: synthetic world seed")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=cmd_serve)

    parser_class = sub._parser_class
    sub._parser_class = _OverridesParser  # only `train` takes free-form --section.key overrides
    train = sub.add_parser(
        "train",
        help="train or fine-tune a dual encoder (one process, or every process under torchrun)",
        description="Train with the paper's contrastive loss from a YAML config (sections model, data, optim, "
        "train, log, eval) or a packaged recipe (pretrain_align, pretrain_align_b7, finetune_flickr30k, "
        "finetune_mscoco, nano_cpu). Any field can be overridden as --section.key VALUE (YAML value; "
        "nested model fields as --model.image.batch_norm virtual); unknown keys are errors.",
        epilog="examples:\n"
        "  openalign train --config nano_cpu --train.run_dir runs/nano\n"
        "  openalign train --config nano_cpu --train.run_dir runs/nano --resume latest\n"
        "  openalign train --config pretrain_align_b7 --data.shards 'shards/{00000..00999}.tar' \\\n"
        "      --data.tokenizer vocab/ --train.chunk_size 512          # 16384 pairs on one GPU\n"
        "  torchrun --nproc-per-node 8 -m openalign.cli train --config pretrain_align \\\n"
        "      --data.shards 'shards/{00000..09999}.tar' --data.tokenizer vocab/\n"
        "  torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr HOST --master-port 29500 \\\n"
        "      -m openalign.cli train --config pretrain_align ...\n"
        "  openalign train --config finetune_flickr30k --model.init ./align-base --data.shards 'f30k/{0..29}.tar'\n"
        "  openalign train --config nano_cpu --print-config        # the resolved config, as YAML",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub._parser_class = parser_class
    train.add_argument("--config", required=True, metavar="CONFIG", help="YAML file or packaged recipe name")
    train.add_argument(
        "--resume",
        metavar="latest|PATH",
        help="continue from RUN_DIR's newest checkpoint (latest; starts fresh if there is none) or a step_* dir",
    )
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    train.set_defaults(func=cmd_train, overrides=[])

    plot = sub.add_parser(
        "plot",
        help="plot a training run's loss, temperature, learning rate and held-out R@1",
        description="Draw loss, temperature, learning rate and held-out R@1 over steps from RUN_DIR/metrics.jsonl "
        "into one PNG.",
        epilog="examples:\n  openalign plot runs/nano\n  openalign plot runs/b7-base --out b7-base.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plot.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory (or its metrics.jsonl)")
    plot.add_argument("--out", metavar="PNG", help="output image (default RUN_DIR/metrics.png)")
    plot.set_defaults(func=cmd_plot)

    demo = sub.add_parser(
        "demo",
        help="the whole pipeline on the built-in synthetic corpus (about ten minutes on two CPU cores)",
        description="Generate a noisy alt-text crawl, filter it with the ALIGN rules, remove near-duplicates of "
        "the test images, learn a WordPiece vocabulary, write shards, train the nano model, evaluate it "
        "zero-shot, index the shards and run example queries; writes report.md with tables and plots. "
        "A second run in the same folder reuses the finished stages.",
        epilog="examples:\n  openalign demo\n  openalign demo --out runs/demo2 --steps 1200\n  openalign demo --quick",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--out", default="runs/demo", help="run folder (default runs/demo)")
    demo.add_argument("--quick", action="store_true", help="small sizes: about a minute, for a first look")
    demo.add_argument("--corpus-size", type=int, help="crawled pairs to generate (default 40000)")
    demo.add_argument("--steps", type=int, help="training steps (default 800)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the crawl, the weights and the data order")
    demo.add_argument(
        "--seeds", type=int, default=1, help="run this many seeds from --seed, in OUT/seed-S, and compare"
    )
    demo.set_defaults(func=cmd_demo)

    experiments = sub.add_parser(
        "experiments",
        help="the paper's ablations in miniature: data noise vs size, temperature, negatives, embed dim, smoothing",
        description="Train the nano model on the synthetic world several times with one factor changed (a: noisy "
        "data at 1x/2x/4x the size of a clean set, b: learned vs fixed temperature, c: fraction of in-batch "
        "negatives, d: embedding size, e: label smoothing), over several seeds; evaluate each final model on a "
        "held-out retrieval set and write OUT/experiments.json and OUT/experiments.md (mean ± std per variant, "
        "the paper's direction and the trend measured here). Finished runs are reused by a second invocation.",
        epilog="examples:\n"
        "  openalign experiments --quick                 # the whole grid on a small budget\n"
        "  openalign experiments --only b,d --seeds 5\n"
        "  openalign experiments --quick --only e --seeds 1 --steps 3 --out /tmp/xp",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    experiments.add_argument("--out", default="runs/experiments", help="output folder (default runs/experiments)")
    experiments.add_argument(
        "--quick", action="store_true", help="a smaller budget: 200 steps of batch 128 (about an hour on 2 cores)"
    )
    experiments.add_argument("--only", metavar="A,B", help="ablations to run, from a,b,c,d,e (default all)")
    experiments.add_argument("--seeds", type=int, default=3, help="seeds per variant (default 3)")
    experiments.add_argument("--steps", type=int, help="training steps per run (default 400; 200 with --quick)")
    experiments.set_defaults(func=cmd_experiments)

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
    model.add_argument(
        "--memory-format",
        default="default",
        choices=["default", "channels-last", "contiguous"],
        help="image layout: each model's default (ours NHWC, transformers NCHW), or the same for both",
    )
    model.add_argument("--channels-last", action="store_true", help="shorthand for --memory-format channels-last")
    model.add_argument(
        "--text-lengths",
        default="alt-text",
        choices=["alt-text", "full"],
        help="alt-text: captions of 6-32 tokens padded to 64 (default); full: every row uses all 64",
    )
    model.add_argument("--no-baseline", action="store_true", help="measure only our model")
    model.add_argument("--json", help="also write the results to this JSON file")
    model.set_defaults(func=cmd_bench_model)
    btrain = bench_sub.add_parser(
        "train",
        help="training steps from shards, split by phase, against a plain transformers AlignModel loop",
        description="Pairs/s, time per step split into data / forward / loss / backward / optimizer, peak memory "
        "and MFU of our training step (dual encoder, contrastive loss, LAMB, our input stream) and of a plain "
        "loop over transformers' AlignModel (its own loss, torch AdamW) on the same batches of the same "
        "synthetic shards, in one run; then the input pipeline alone (samples/s in one process and per "
        "worker) against webdataset's pipeline.",
        epilog="examples:\n"
        "  openalign bench train\n"
        "  openalign bench train --preset nano --batch-size 128 --steps 8\n"
        "  openalign bench train --preset b0-tiny --device cuda --bf16 --batch-size 256 --workers 8",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    btrain.add_argument("--preset", default="nano", help="model preset (default nano)")
    btrain.add_argument("--image-size", type=int, default=None, help="square crop size (default: the preset's)")
    btrain.add_argument("--batch-size", type=int, default=256, help="pairs per step (default 256, the nano_cpu recipe)")
    btrain.add_argument("--steps", type=int, default=5, help="timed steps per round")
    btrain.add_argument("--warmup", type=int, default=2, help="untimed steps per round")
    btrain.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best round counts")
    btrain.add_argument("--workers", type=int, default=2, help="DataLoader workers feeding each loop")
    btrain.add_argument("--device", default="cpu", help="cpu or cuda")
    btrain.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU)")
    btrain.add_argument("--shard-samples", type=int, default=512, help="synthetic pairs written as shards")
    btrain.add_argument("--pipeline-samples", type=int, default=1024, help="samples timed for the pipeline figure")
    btrain.add_argument("--no-baseline", action="store_true", help="measure only ours")
    btrain.add_argument("--json", help="also write the results to this JSON file")
    btrain.set_defaults(func=cmd_bench_train)
    bsearch = bench_sub.add_parser(
        "search",
        help="approximate index vs exact NumPy search: build time, memory, latency, recall@10",
        description="Index N clustered synthetic vectors and time single queries through it and through exact "
        "NumPy search on the same data, in one run; recall@k is measured against exact search.",
        epilog="examples:\n"
        "  openalign bench search                      # 1M × 640\n"
        "  openalign bench search --n 200000 --kind hnsw --json search.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bsearch.add_argument("--n", type=int, default=1_000_000, help="vectors (default 1000000)")
    bsearch.add_argument("--dim", type=int, default=640, help="width (default 640)")
    bsearch.add_argument("--queries", type=int, default=500, help="timed ANN queries (default 500)")
    bsearch.add_argument("--exact-queries", type=int, default=30, help="timed exact queries (default 30)")
    bsearch.add_argument("-k", type=int, default=10)
    bsearch.add_argument("--kind", default="auto", choices=["auto", "exact", "ivf_flat", "ivf_pq", "hnsw"])
    bsearch.add_argument("--memory-budget-mb", type=float, default=8192.0)
    bsearch.add_argument("--target-recall", type=float, default=0.95)
    bsearch.add_argument("--seed", type=int, default=0)
    bsearch.add_argument("--json", help="also write the results to this JSON file")
    bsearch.set_defaults(func=cmd_bench_search)
    bserve = bench_sub.add_parser(
        "serve",
        help="load test: concurrent clients against the real search server on loopback",
        description="Start `openalign serve` in its own process and send CLIENTS × REQUESTS POST /search "
        "(text, more-like-this and image+text queries) from concurrent clients; report p50/p99 and errors. "
        "Exits 1 if any request got a 5xx or failed.",
        epilog="examples:\n  openalign bench serve\n  openalign bench serve --index photos.index --clients 32",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bserve.add_argument("--index", help="index directory (default: the demo index)")
    bserve.add_argument("--clients", type=int, default=16)
    bserve.add_argument("--requests", type=int, default=1000, help="requests per client")
    bserve.add_argument("-k", type=int, default=10)
    bserve.add_argument("--json", help="also write the results to this JSON file")
    bserve.set_defaults(func=cmd_bench_serve)
    bfilter = bench_sub.add_parser(
        "filter",
        help="the ALIGN rules on DuckDB against a straightforward pandas implementation",
        description="Writes a synthetic alt-text corpus (Zipf vocabulary, junk tokens, shared boilerplate, "
        "popular images, sizes around the thresholds) to Parquet, filters all of it with DuckDB and its first "
        "BASELINE_ROWS rows with pandas (time scaled to the full size), prints rows/s for both and the ratio, "
        "and checks that both keep the same rows of the subsample.",
        epilog="examples:\n"
        "  openalign bench filter                       # 10M rows, pandas on 1M\n"
        "  openalign bench filter --rows 2000000 --baseline-rows 200000",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bfilter.add_argument("--rows", type=int, default=10_000_000, help="corpus rows (default 10000000)")
    bfilter.add_argument("--baseline-rows", type=int, default=1_000_000, help="pandas subsample (default 1000000)")
    bfilter.add_argument("--top-k", type=int, help="vocabulary size K (default 40000)")
    bfilter.add_argument("--threads", type=int, help="duckdb threads (default: all cores)")
    bfilter.add_argument("--seed", type=int, default=0)
    bfilter.add_argument("--work-dir", help="where the temporary corpus goes (default: system temp)")
    bfilter.add_argument("--json", help="also write the results to this JSON file")
    bfilter.set_defaults(func=cmd_bench_filter)
    bdedup = bench_sub.add_parser(
        "dedup",
        help="bucketed near-duplicate search against exact brute force (time, speed-up, recall)",
        description="Synthetic embeddings with planted near-duplicates and near misses; our pipeline on all of "
        "them, brute force (blocked exact matrix products) on a train subsample, scaled to the full size. "
        "Prints both times, the ratio, and the recall against brute force.",
        epilog="examples:\n"
        "  openalign bench dedup                                  # 1M × 50k, 640-d\n"
        "  openalign bench dedup --train 200000 --test 10000 --engine sparse",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bdedup.add_argument("--train", type=int, default=1_000_000, help="train embeddings (default 1000000)")
    bdedup.add_argument("--test", type=int, default=50_000, help="test embeddings (default 50000)")
    bdedup.add_argument("--dim", type=int, default=640, help="embedding width (default 640)")
    bdedup.add_argument("--brute-train", type=int, default=32_768, help="train rows brute force runs on")
    _add_dedup_flags(bdedup, with_seed=False)
    bdedup.add_argument("--seed", type=int, default=0, help="data and k-means seed")
    bdedup.add_argument("--json", help="also write the results to this JSON file")
    bdedup.set_defaults(func=cmd_bench_dedup)
    bretrieval = bench_sub.add_parser(
        "retrieval",
        help="recall_at_k on given embeddings against the bare matrix product it needs (time, ratio)",
        description="MSCOCO-sized by default (5K images × 25K captions × 640-d, each caption its image's unit "
        "vector plus noise): the time of the one float32 image × caption matrix product every score needs, and "
        "of recall_at_k with float32 scores and at its default precision (bfloat16 with an exact recount where "
        "the CPU multiplies bfloat16 natively), in alternating rounds; checks both give the same recalls.",
    )
    bretrieval.add_argument("--images", type=int, default=5000, help="images (default 5000)")
    bretrieval.add_argument("--captions-per-image", type=int, default=5, help="captions per image (default 5)")
    bretrieval.add_argument("--dim", type=int, default=640, help="embedding width (default 640)")
    bretrieval.add_argument(
        "--noise", type=float, default=9.0, help="caption noise relative to the image vector (default 9: R@1 ~20 %%)"
    )
    bretrieval.add_argument("--independent", action="store_true", help="captions independent of the images")
    bretrieval.add_argument("--rounds", type=int, default=3, help="timed rounds; the best is kept (default 3)")
    bretrieval.add_argument("--seed", type=int, default=0, help="data seed")
    bretrieval.add_argument("--json", help="also write the results to this JSON file")
    bretrieval.set_defaults(func=cmd_bench_retrieval)
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
