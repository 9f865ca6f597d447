"""The pass pipeline: one ordered list of passes over a captured GraphModule.

Each pass is a plain function `pass_(gm, ctx) -> report` that rewrites gm in place and returns a small dict
saying what it matched; the graph is linted and recompiled after every pass. Set MOECOMPILE_PRINT_GRAPH=1 to
print the graph before the first pass and after each one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from torch import fx

from .find_ffn import find_ffn
from .insert_fp8 import insert_fp8
from .moeize import moeize

# dense -> MoE conversion, in order. Later stages (recognise_moe, fuse_route_dispatch, insert_fp8,
# insert_all_to_all) join this list as they land.
PIPELINE = [find_ffn, moeize, insert_fp8]


@dataclass
class PassContext:
    options: dict = field(default_factory=dict)
    ffns: list = field(default_factory=list)  # set by find_ffn
    reports: list[tuple[str, dict]] = field(default_factory=list)


def run_pipeline(gm: fx.GraphModule, options: dict | None = None, passes=None) -> tuple[fx.GraphModule, PassContext]:
    ctx = PassContext(options=dict(options or {}))
    verbose = os.environ.get("MOECOMPILE_PRINT_GRAPH", "") not in ("", "0")
    if verbose:
        print("=== graph before passes ===\n" + gm.graph.python_code("self").src)
    for p in PIPELINE if passes is None else passes:
        report = p(gm, ctx)
        gm.graph.lint()
        gm.recompile()
        ctx.reports.append((p.__name__, report))
        if verbose:
            print(f"=== after {p.__name__}: {report} ===\n" + gm.graph.python_code("self").src)
    return gm, ctx
