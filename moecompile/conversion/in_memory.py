"""moeize: replace the FFNs that the front end finds by MoEBlocks, in memory (the module view).

    model = moecompile.moeize(model, experts=16, top_k=2, method="upcycle")  # defaults: moecompile.ir.knobs

How each block is built from its FFN (upcycle, split): moecompile/ffn/build.py.
"""
from __future__ import annotations

from torch import nn
from tqdm.auto import tqdm

from moecompile.core.errors import MoECompileError
from moecompile.ffn.build import build_block, check_ffns, check_options
from moecompile.ffn.layers import parse_layers
from moecompile.ir import layout
from moecompile.ir.knobs import CAPACITY_FACTOR, EXPERTS, METHOD, TOP_K
from moecompile.passes.find_ffn import find_dense_ffns


def moeize(model: nn.Module, experts: int = EXPERTS, top_k: int = TOP_K, capacity_factor: float = CAPACITY_FACTOR,
           method: str = METHOD, layers=None, noise: float = 0.0, seed: int = 0,
           example_args=None, example_kwargs=None, progress: bool = True) -> nn.Module:
    """Replace the model's FFNs (those `layers` selects, in graph order) by MoEBlocks, in place; returns model.
    capacity_factor: see MoEConfig."""
    check_options(experts, top_k, method)
    found, skipped = find_dense_ffns(model, example_args, example_kwargs)
    if not found:
        why = f" ({'; '.join(skipped)})" if skipped else ""
        raise MoECompileError(f"no FFN found in {type(model).__name__}{why}")
    indices = parse_layers(layers, len(found))
    if not indices:
        raise MoECompileError(f"--layers {layers!r} selects none of the {len(found)} FFNs")
    check_ffns([found[i] for i in indices], experts, method)
    for index in tqdm(indices, desc=f"moeize ({method})", unit="layer", disable=not progress):
        ffn = found[index]
        block = build_block(ffn, experts, top_k, capacity_factor, method, noise, seed, index=index)
        block.train(model.training)
        model.set_submodule(ffn.owner, block)
        for path in ffn.identity:
            model.set_submodule(path, nn.Identity())
        layout.record(model, ffn.owner, block.config, ffn.identity)
    return model
