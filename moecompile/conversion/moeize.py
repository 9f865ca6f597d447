"""moeize: replace the FFNs that the front end finds by MoEBlocks (the module view).

    model = moecompile.moeize(model, experts=16, top_k=2, method="upcycle")  # defaults: moecompile.ir.knobs

Expert construction (`method`):
- "upcycle": every expert a copy of the dense FFN (optionally with noise). Exactly the dense output at init for
  any top_k when no token is dropped, since the renormalised top-k weights sum to 1.
- "split": the hidden neurons partitioned into `experts` balanced groups by k-means on the neurons' weights;
  every selected expert has weight 1 and the output bias is added once, so top_k = experts is exactly dense.
  The router starts at each group's mean input weight, a heuristic; calibrated routers are built elsewhere.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import fx, nn
from tqdm.auto import tqdm

from moecompile.conversion.frontend import capture, module_scopes
from moecompile.core.errors import MoECompileError
from moecompile.ir import layout
from moecompile.ir.block import MoEBlock
from moecompile.ir.config import MoEConfig
from moecompile.ir.knobs import (
    CAPACITY_FACTOR,
    EXPERTS,
    METHOD,
    TOP_K,
    check_experts,
    check_method,
    check_split,
    check_top_k,
)
from moecompile.passes.find_ffn import TRANSPARENT, FFNMatch, LinearRef, find_ffns


@dataclass
class DenseFFN:
    """One FFN found in a model: its weights as [out, in], and which modules a replacement takes over."""
    match: FFNMatch
    owner: str | None  # module replaced by the MoEBlock (None in the graph view)
    identity: list[str]  # modules replaced by nn.Identity (absorbed into the block)
    w_in: torch.Tensor  # [F, H]: the first projection (gate rows then up rows when gated)
    b_in: torch.Tensor | None
    w_out: torch.Tensor  # [H, I]
    b_out: torch.Tensor | None
    dropout: float  # of the replaced module's output, kept by the block

    @property
    def hidden_size(self) -> int:
        return self.w_out.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w_out.shape[1]

    def describe(self) -> str:
        return f"{self.owner}: {self.match.describe()}, hidden {self.hidden_size}, ffn {self.intermediate_size}"


def _param(root: nn.Module | Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    return root[name] if isinstance(root, Mapping) else root.get_parameter(name).detach()


def _weight(root, ref: LinearRef) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = _param(root, ref.weight)
    b = _param(root, ref.bias) if ref.bias else None
    return (w if ref.out_in else w.t()), b


def dense_ffn(root: nn.Module | Mapping[str, torch.Tensor], match: FFNMatch, owner: str | None = None,
              identity: list[str] | None = None) -> DenseFFN:
    """The matched FFN's weights, read from root: the model, the captured GraphModule (same parameter names), or a
    mapping of those names to tensors (the streaming split reads an FFN's tensors from its checkpoint)."""
    ins = [_weight(root, r) for r in (match.gate, match.up) if r is not None]
    w_in = torch.cat([w for w, _ in ins])
    if all(b is None for _, b in ins):
        b_in = None
    else:
        b_in = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in ins])
    w_out, b_out = _weight(root, match.down)
    return DenseFFN(match, owner, list(identity or []), w_in, b_in, w_out, b_out, 0.0)


def _scope(scopes, path):
    return {n for n, paths in scopes.items()
            if path in paths and n.target is not torch.ops.aten._assert_tensor_metadata.default}


def _is_passthrough(node: fx.Node) -> bool:
    return node.target in TRANSPARENT and torch.Tag.pointwise not in getattr(node.target, "tags", ())


def _ancestors(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _plan(model: nn.Module, gm: fx.GraphModule, match: FFNMatch, scopes) -> tuple[str, list[str]]:
    """Which module the MoEBlock replaces: the FFN's own module when it holds nothing else (GPT-2 mlp, LLaMA mlp),
    otherwise the module of the first projection and activation, with the second projection made an Identity
    (BERT: intermediate -> MoEBlock, output.dense -> Identity, output's LayerNorm kept)."""
    ffn_nodes = set(match.chain) | {r.node for r in match.linears}
    paths = [r.module for r in match.linears]
    common = paths[0].split(".")
    for p in paths[1:]:
        parts = p.split(".")
        n = 0
        while n < min(len(common), len(parts)) and common[n] == parts[n]:
            n += 1
        common = common[:n]
    owner = ".".join(common)
    if owner and owner not in paths and all(n in ffn_nodes or _is_passthrough(n) for n in _scope(scopes, owner)):
        return owner, []
    # split form: the largest ancestor of the input projections holding only them and the activation chain
    in_nodes = ffn_nodes - {match.down.node}
    best = None
    for cand in _ancestors(match.up.module):
        scope = _scope(scopes, cand)
        if match.down.node in scope or not all(n in in_nodes or _is_passthrough(n) for n in scope):
            break
        if all(r.node in scope for r in match.linears[:-1]) and set(match.chain) <= scope:
            best = cand
    down_scope = _scope(scopes, match.down.module)
    if best is None or not all(n is match.down.node or _is_passthrough(n) for n in down_scope):
        raise MoECompileError(f"found {match.describe()} but no module boundary to replace it at")
    return best, [match.down.module]


def find_dense_ffns(model: nn.Module, example_args=None, example_kwargs=None) -> tuple[list[DenseFFN], list[str]]:
    """Capture the model and return its rewritable FFNs in graph order, plus one line per FFN skipped and why."""
    gm = capture(model, example_args, example_kwargs)
    matches, skipped = find_ffns(gm)
    scopes = module_scopes(gm)
    found = []
    for match in matches:
        try:
            owner, identity = _plan(model, gm, match, scopes)
        except MoECompileError as e:
            skipped.append(str(e))
            continue
        ffn = dense_ffn(model, match, owner, identity)
        if ffn.w_out.shape[0] != ffn.w_in.shape[1]:
            skipped.append(f"{owner}: output size {ffn.w_out.shape[0]} differs from input size {ffn.w_in.shape[1]}")
            continue
        if not identity:
            ffn.dropout = next((m.p for m in model.get_submodule(owner).children() if isinstance(m, nn.Dropout)), 0.0)
        found.append(ffn)
    return found, skipped


def parse_layers(spec, count: int) -> list[int]:
    """Layer selection: None/"all", "even", "odd", or indices and ranges like "0,2,5-7" (negative from the end)."""
    if spec is None or spec == "all":
        return list(range(count))

    def index(i: int) -> int:  # negative from the end, checked
        j = i + count if i < 0 else i
        if not 0 <= j < count:
            raise MoECompileError(f"layer {i} out of range: the model has {count} FFN layers")
        return j

    if isinstance(spec, (list, tuple)):
        items = [index(int(i)) for i in spec]
    elif spec in ("even", "odd"):
        return list(range(0 if spec == "even" else 1, count, 2))
    else:
        items = []
        for part in str(spec).split(","):
            part = part.strip()
            m = re.fullmatch(r"(-?\d+)(?:-(-?\d+))?", part)
            if not m:
                raise MoECompileError(f"bad --layers spec {spec!r}: use 'all', 'even', 'odd' or e.g. '0,2,5-7'")
            lo = index(int(m.group(1)))  # resolve negative ends before expanding the range ("-3--1", "2--1")
            hi = index(int(m.group(2))) if m.group(2) is not None else lo
            if hi < lo:
                raise MoECompileError(f"bad --layers spec {spec!r}: range {part!r} is empty (start after end)")
            items.extend(range(lo, hi + 1))
    return sorted(set(items))


def balanced_kmeans(features: torch.Tensor, clusters: int, iters: int = 10, seed: int = 0) -> torch.Tensor:
    """Assign rows to `clusters` equal-size groups by spherical k-means with a greedy balanced assignment.
    Returns the group index per row. Deterministic for a given seed."""
    n = features.shape[0]
    size = n // clusters
    x = features.to(torch.float32, copy=True)
    torch.nn.functional.normalize(x, dim=1, out=x)  # in place: one float32 copy of the features at a time
    gen = torch.Generator().manual_seed(seed)
    centroids = x[torch.randperm(n, generator=gen)[:clusters]]
    assign = torch.empty(n, dtype=torch.long)
    for _ in range(iters):
        scores = x @ centroids.t()
        top2 = scores.topk(min(2, clusters), dim=1).values
        confidence = top2[:, 0] - (top2[:, 1] if clusters > 1 else 0)
        room = torch.full((clusters,), size, dtype=torch.long)
        for i in torch.argsort(confidence, descending=True, stable=True).tolist():
            e = int(torch.where(room > 0, scores[i], float("-inf")).argmax())
            assign[i] = e
            room[e] -= 1
        new = torch.stack([x[assign == e].mean(0) for e in range(clusters)])
        new = torch.nn.functional.normalize(new, dim=1)
        if torch.allclose(new, centroids):
            break
        centroids = new
    return assign


def _neuron_groups(ffn: DenseFFN, experts: int, seed: int) -> list[torch.Tensor]:
    i = ffn.intermediate_size
    # per neuron: its gate|up rows, then its output column (the rows' copy is freed once concatenated)
    features = torch.cat([ffn.w_in.reshape(-1, i, ffn.hidden_size).permute(1, 0, 2).reshape(i, -1), ffn.w_out.t()],
                         dim=1)
    assign = balanced_kmeans(features, experts, seed=seed)
    return [torch.nonzero(assign == e).flatten() for e in range(experts)]


ROUTER_STD = 0.02  # upcycled routers: small, so every expert starts near an even share of the tokens


def ffn_seed(seed: int, index: int) -> int:
    """The seed of everything random about the FFN numbered `index` (in model order, as --layers counts): it depends
    on (seed, index) alone, not on which other FFNs are converted nor on the order they are written in."""
    return seed * 1_000_003 + index


def upcycle_router(seed: int, index: int, experts: int, hidden: int, std: float = ROUTER_STD) -> torch.Tensor:
    """The router weight [experts, hidden] (float32) of an upcycled FFN, normal(0, std): moeize and the streaming
    native upcycle both draw it here, so their outputs are bit-identical."""
    g = torch.Generator().manual_seed(ffn_seed(seed, index))
    return torch.randn((experts, hidden), generator=g, dtype=torch.float32) * std


def upcycle_copy(w: torch.Tensor, seed: int, index: int, proj: int, expert: int, noise: float) -> torch.Tensor:
    """Expert `expert`'s copy of the dense projection w [out, in] (proj: 0 the first or gate projection, 1 up,
    2 down) plus normal noise of noise * std(w), which breaks the symmetry between the copies; w itself at noise 0."""
    if noise <= 0:
        return w
    g = torch.Generator().manual_seed((ffn_seed(seed, index) * 3 + proj) * 4099 + expert + 1)
    wf = w.float()
    return (wf + torch.randn(wf.shape, generator=g) * (noise * wf.std())).to(w.dtype)


def block_config(ffn: DenseFFN, experts: int, top_k: int, capacity_factor: float, method: str,
                 groups: list[torch.Tensor] | None = None) -> MoEConfig:
    """The MoEConfig of the block build_block makes from this FFN: its shapes only, so the streaming split plans its
    output from a DenseFFN of meta tensors before reading any weight."""
    common = dict(hidden_size=ffn.hidden_size, num_experts=experts, top_k=top_k, capacity_factor=capacity_factor,
                  activation=ffn.match.activation, gated=ffn.match.gated, bias_in=ffn.b_in is not None,
                  dropout=ffn.dropout, method=method)
    if method == "upcycle":
        return MoEConfig(expert_size=ffn.intermediate_size, bias_out="expert" if ffn.b_out is not None else "none",
                         **common)
    # given groups may leave neurons out (a calibrated split's shared expert holds them)
    size = ffn.intermediate_size // experts if groups is None else len(groups[0])
    return MoEConfig(expert_size=size, bias_out="shared" if ffn.b_out is not None else "none", gate_weighting="unit",
                     **common)


def build_block(ffn: DenseFFN, experts: int, top_k: int, capacity_factor: float, method: str,
                noise: float = 0.0, seed: int = 0, groups: list[torch.Tensor] | None = None,
                index: int = 0) -> MoEBlock:
    """An MoEBlock equivalent to the dense FFN (at init, see the module docstring). `groups` (split only): the
    neuron indices of each expert, instead of the weight k-means (calibration passes co-activation groups).
    `index`: the FFN's number in the model, which with `seed` draws its router, noise and k-means (ffn_seed).
    The arguments are checked where they enter: check_options and check_ffns."""
    gated = ffn.match.gated
    h, i = ffn.hidden_size, ffn.intermediate_size
    config = block_config(ffn, experts, top_k, capacity_factor, method, groups)
    block = MoEBlock(config).to(dtype=ffn.w_in.dtype, device=ffn.w_in.device)
    if method == "upcycle":
        # the first projection's rows: (gate, up) when gated, else one projection
        parts = [(0, ffn.w_in[:i]), (1, ffn.w_in[i:])] if gated else [(0, ffn.w_in)]
        with torch.no_grad():
            ex = block.experts
            for e in range(experts):
                ex.w_in[e] = torch.cat([upcycle_copy(w, seed, index, proj, e, noise) for proj, w in parts])
                ex.w_out[e] = upcycle_copy(ffn.w_out, seed, index, 2, e, noise)
            if ex.b_in is not None:
                ex.b_in.copy_(ffn.b_in.expand_as(ex.b_in))
            if ex.b_out is not None:
                ex.b_out.copy_(ffn.b_out.expand_as(ex.b_out))
            block.router.weight.copy_(upcycle_router(seed, index, experts, h))
        return block
    if groups is None:
        groups = _neuron_groups(ffn, experts, ffn_seed(seed, index))
    w_in = ffn.w_in.reshape(-1, i, h)  # [1 or 2 (gate, up), I, H]
    with torch.no_grad():
        ex = block.experts
        for e, idx in enumerate(groups):
            ex.w_in[e] = w_in[:, idx].reshape(-1, h)
            ex.w_out[e] = ffn.w_out[:, idx]
            if ex.b_in is not None:
                ex.b_in[e] = ffn.b_in.reshape(-1, i)[:, idx].reshape(-1)
            block.router.weight[e] = w_in[0, idx].float().mean(0)
        if block.bias is not None:
            block.bias.copy_(ffn.b_out)
    return block


def check_options(experts, top_k, method: str) -> None:
    """A conversion's knobs, checked where they enter (moeize() and the graph pass), before the model is captured."""
    check_experts(experts)
    check_top_k(top_k, experts)
    check_method(method)


def check_ffns(ffns: list[DenseFFN], experts: int, method: str) -> None:
    """What the chosen FFNs require of the knobs (a split divides each FFN evenly), checked before any is replaced."""
    if method == "split":
        for ffn in ffns:
            check_split(ffn.intermediate_size, experts, ffn.owner)


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
