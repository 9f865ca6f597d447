"""Command-line pieces shared by the training examples."""
from __future__ import annotations

import argparse

import torch


def add_moe_args(p: argparse.ArgumentParser, noise: float) -> None:
    """--experts, --top-k, --capacity-factor, --noise (upcycling), --seed, --device, --threads."""
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25,
                   help="> 0 fixed capacity (overflow dropped), 0 dropless")
    p.add_argument("--noise", type=float, default=noise, help="relative noise on each upcycled expert copy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch; 0: torch's default. Default 1: these small models run many tiny "
                        "ops, which a second thread barely speeds up and which ran up to 16x slower with 2 threads "
                        "on a busy shared 2-core machine")


def apply_threads(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
