"""``slotread models``: list or fetch registry models, or write a tiny or weightless test model."""

from __future__ import annotations

import argparse
from pathlib import Path

from slotread.cli.flags import add_dtype_flag, default
from slotread.models.shapes import SHAPES
from slotread.settings import ModelSettings


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    models = commands.add_parser("models", help="list or fetch registry models, or write a tiny test model")
    model_commands = models.add_subparsers(dest="models_command", required=True)
    listing = model_commands.add_parser("list", help="show the registry models and which are cached")
    listing.set_defaults(run=run_list)
    fetch = model_commands.add_parser(
        "fetch", help="fetch and convert models now (e.g. before serving offline); prints each checkpoint folder"
    )
    fetch.add_argument("names", nargs="+", metavar="MODEL", help="registry name, checkpoint dir or .gguf file")
    add_dtype_flag(fetch, ModelSettings, "the dtype the model will be served in; its weights are stored so")
    fetch.set_defaults(run=run_fetch)
    tiny = model_commands.add_parser("tiny", help="write a tiny random-weight checkpoint")
    tiny.add_argument("architecture", choices=["diffusion-gemma", "bert", "modernbert"], help="which architecture")
    tiny.add_argument("--out", required=True, help="directory to write the checkpoint to")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    tiny.set_defaults(run=run_tiny)
    shape = model_commands.add_parser(
        "shape", help="write a real model shape without weights, to serve with random weights (random:DIR)"
    )
    shape.add_argument("shape", choices=sorted(SHAPES), help="which shape")
    shape.add_argument("--out", required=True, help="directory to write the config and tokenizer to")
    shape.set_defaults(run=run_shape)


def run_list(args: argparse.Namespace) -> int:
    from slotread.models.load import list_models

    rows = list_models(args.cache_dir)
    width = max(len(row.name) for row in rows)
    for row in rows:
        status = f"cached at {row.path}" if row.cached else "not cached (fetched on first use)"
        print(f"{row.name:<{width}}  {row.description}\n{'':<{width}}  {status}")
    return 0


def run_fetch(args: argparse.Namespace) -> int:
    import torch

    from slotread.models.fetch import default_cache_dir
    from slotread.models.load import checkpoint_dir

    cache = args.cache_dir if args.cache_dir is not None else default_cache_dir()
    dtype = getattr(torch, args.dtype or default(ModelSettings, "dtype"))
    for name in args.names:
        print(f"{name}: {checkpoint_dir(name, cache, dtype)}")
    return 0


def run_shape(args: argparse.Namespace) -> int:
    from slotread.models.shapes import write_shape

    path = write_shape(args.shape, Path(args.out), cache_dir=args.cache_dir)
    print(
        f"wrote the {args.shape} shape (config and tokenizer, no weights) to {path}; serve it with random weights "
        f"(answers are noise) with --model random:{path} --device cuda"
    )
    return 0


def run_tiny(args: argparse.Namespace) -> int:
    from slotread.models.tiny_checkpoint import write_tiny_diffusion_gemma
    from slotread.models.tiny_masked import write_tiny_masked_lm

    if args.architecture == "diffusion-gemma":
        path = write_tiny_diffusion_gemma(Path(args.out), cache_dir=args.cache_dir, seed=args.seed)
    else:
        path = write_tiny_masked_lm(args.architecture, Path(args.out), cache_dir=args.cache_dir, seed=args.seed)
    print(f"wrote a tiny random-weight {args.architecture} to {path}; use it with --model {path}")
    return 0
