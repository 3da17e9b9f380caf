"""Arguments shared by several subcommands, and loading the workload they name."""

from __future__ import annotations

import argparse

from ..workload import LoadedWorkload, load_workload, parse_shape


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="gpt",
                   help="built-in name (gpt, cnn, mlp), path/to/file.py:fn or package.module:fn (default: gpt)")
    p.add_argument("--shape", default="", help="shape keywords for the workload factory, e.g. batch_size=8,seq_len=256")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def load_from_args(args: argparse.Namespace) -> LoadedWorkload:
    return load_workload(args.workload, parse_shape(args.shape), device=args.device, dtype=args.dtype)
