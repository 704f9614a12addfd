"""``openalign eval TASK`` and ``openalign eval suite``.

A task's settings are the ``Option`` s it declares (``openalign.eval.tasks``); they become flags, a
``--config`` YAML and a suite entry through the same code as every other command's dataclass fields.
"""

from __future__ import annotations

import argparse
import sys

from openalign.cli import schema
from openalign.cli.options import Parser, add_config, data, print_config


def register(sub: argparse._SubParsersAction) -> None:
    sub.add_parser(
        "eval",
        help="evaluate a model: retrieval, zero-shot classification, KNN, ... or a suite of them",
        add_help=False,
        build=_build,
    )


def _build(parser: Parser) -> None:
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("task", nargs="?", metavar="TASK")
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    parser.set_defaults(func=run)


def tasks() -> dict[str, schema.TaskInfo]:
    """Every task's name, help and options, read from source; imported when a declaration is not literal."""
    try:
        return schema.eval_tasks()
    except (ValueError, SyntaxError, KeyError):
        from openalign.eval.tasks import load_tasks

        return {
            name: schema.TaskInfo(
                name,
                task.help,
                tuple(
                    schema.Knob(o.name, o.type.__name__, o.default, o.help, o.choices, o.metavar, o.required)
                    for o in task.all_options()
                ),
                task.examples,
                task.description,
            )
            for name, task in load_tasks().items()
        }


def overview() -> str:
    lines = [
        "usage: openalign eval TASK --model CKPT [options] [--out DIR]",
        "       openalign eval suite SUITE.yaml [--model CKPT] [--out DIR] [--resume]",
        "",
        "Evaluate a model the way the ALIGN paper does; `openalign eval TASK --help` lists a task's options.",
        "",
        "tasks:",
    ]
    found = tasks()
    width = max([len(n) for n in found] + [5])
    lines += [f"  {name:<{width}}  {found[name].help}" for name in sorted(found)]
    lines += [f"  {'suite':<{width}}  run the tasks listed in a YAML file, loading the model once"]
    lines += ["", "examples:"]
    lines += [f"  {ex}" for name in sorted(found) for ex in found[name].examples[:1]]
    lines += ["  openalign eval suite suite.yaml --model runs/nano/final --out results/"]
    return "\n".join(lines)


def task_parser(task: schema.TaskInfo) -> Parser:
    """Flags for one eval task, built from its declared options."""
    examples = "".join(f"  {line}\n" for line in task.examples)
    parser = Parser(
        prog=f"openalign eval {task.name}",
        description=task.description or task.help,
        epilog=f"examples:\n{examples}" if examples else None,
    )
    parser.add_argument("--model", help="openalign checkpoint or transformers AlignModel directory (required)")
    parser.add_argument("--tokenizer", help="tokenizer file or directory (default: the model directory)")
    parser.add_argument("--out", help="directory for <task>-<dataset>.json and results.md (default: print only)")
    parser.add_argument(
        "--format",
        choices=("openalign", "clip_benchmark"),
        default="openalign",
        help="result format: openalign (JSON + results.md) or clip_benchmark (its JSON, names and fractions; "
        "retrieval, zeroshot and linear-probe)",
    )
    add_config(parser, schema.Schema(task.options), config_help="YAML mapping of these options (flags override it)")
    return parser


def suite_parser() -> Parser:
    parser = Parser(
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
        "  openalign eval suite suite.yaml --model runs/b0-tiny/final --out results/b0 --resume\n"
        "  openalign eval suite paper-transfer.yaml --root DATA --model runs/b7-base/final  # Tables 4-6\n\n"
        "packaged suites (a bare name that is not a file): paper-transfer.yaml runs ImageNet, VTAB-1k and the\n"
        "fine-grained sets with the paper's recipes, for each folder present under --root DATA: imagenet/,\n"
        "vtab-1k/, flowers102/, pets/, cars/, food101/ (each as released); absent ones are skipped.",
    )
    parser.add_argument("suite", metavar="SUITE.yaml")
    parser.add_argument("--model", help="checkpoint directory (overrides the YAML's model)")
    parser.add_argument("--tokenizer", help="tokenizer file or directory (default: the model directory)")
    parser.add_argument("--out", help="results directory (overrides the YAML's out)")
    parser.add_argument("--device", help="torch device for every task (overrides the YAML)")
    parser.add_argument("--resume", action="store_true", help="skip tasks whose results are already in --out")
    parser.add_argument(
        "--root", help="data folder: {root} in entries stands for it; entries whose 'needs:' folder is absent skip"
    )
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set an option in every entry whose task has it (repeatable), e.g. --option steps=200",
    )
    parser.add_argument(
        "--format",
        choices=("openalign", "clip_benchmark"),
        default="openalign",
        help="result format: openalign (JSON + results.md) or clip_benchmark (its JSON; retrieval, zeroshot and "
        "linear-probe entries only)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    rest = list(args.rest)
    if args.task is None or args.help or args.task in ("-h", "--help"):
        if args.task and args.task not in ("-h", "--help"):
            rest.append("--help")
        elif args.help or args.task:
            print(overview())
            return 0
        else:
            print(overview(), file=sys.stderr)
            print("openalign eval: error: name a TASK (or suite)", file=sys.stderr)
            return 2
    if args.task == "suite":
        return run_suite(suite_parser().parse_args(rest))

    found = tasks()
    if args.task not in found:
        raise ValueError(f"unknown eval task {args.task!r}; valid tasks: {', '.join(sorted(found)) or '(none)'}")
    ns = task_parser(found[args.task]).parse_args(rest)
    options = data(ns)
    if ns.print_config:
        from openalign.eval.tasks import get_task, resolve_options

        print_config(resolve_options(get_task(args.task), options))
        return 0
    if not ns.model:
        raise ValueError("--model is required")
    from openalign.eval.suite import run_eval

    _, markdown = run_eval(args.task, ns.model, options, tokenizer=ns.tokenizer, out=ns.out, format=ns.format)
    print(markdown)
    return 0


def run_suite(ns: argparse.Namespace) -> int:
    from openalign.eval.suite import parse_options, run_suite

    summary = run_suite(
        ns.suite,
        model=ns.model,
        tokenizer=ns.tokenizer,
        out=ns.out,
        device=ns.device,
        resume=ns.resume,
        root=ns.root,
        options=parse_options(ns.option),
        format=ns.format,
    )
    if ns.format == "clip_benchmark":
        import json

        print(json.dumps(summary.clip_benchmark, indent=2))
    else:
        print(summary.markdown)
    if summary.failed:
        print(
            f"openalign eval: error: {len(summary.failed)} task(s) failed: {'; '.join(summary.failed)}", file=sys.stderr
        )
        return 1
    return 0
