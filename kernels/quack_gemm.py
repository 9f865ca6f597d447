"""Expert GEMMs on QuACK (CuTe DSL kernels for Hopper: TMA, wgmma, warp-specialised persistent tiles), the optional
`quack` extra. Both projections are QuACK's varlen-M grouped GEMMs over rows in expert order (the group ends come
from the device as a cumulative table, so no host synchronisation); the first takes its activation (gated or not)
in the epilogue and can gather its A rows straight from the token matrix (`gather_rows`: no permuted copy written).
Training keeps the first projection's pre-activation, and the backward is four more: the activation's derivative in
the epilogue of grad_y W_out, the weight gradients as varlen-K GEMMs over each group's rows, then grad_x; with the
combine folded in (`combined_backward`), the first two read the combine's gradient through each row's token.

Each call runs the tile configuration it is given (`config`: GemmConfig's fields, from the runtime's tuned table) or
QuACK's default, never QuACK's autotuner: that would compile and time every candidate at each new row count.

Leaf module: torch and, lazily, quack. `supported` says whether a call can run here; callers fall back otherwise.
"""
from __future__ import annotations

import functools

import torch

# (our activation, gated) -> QuACK's epilogue activation; QuACK's GELUs are the tanh approximation
ACTIVATIONS = {("silu", True): "swiglu", ("gelu_tanh", True): "geglu", ("relu", True): "reglu",
               ("gelu_tanh", False): "gelu_tanh_approx", ("relu", False): "relu"}
DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def _quack():
    try:
        from quack import gemm_interface
    except Exception:  # not installed, or its CuTe DSL runtime does not load on this machine
        return None
    return gemm_interface


def available(device: torch.device) -> bool:
    return (device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] == 9
            and _quack() is not None)


def supported(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, activation: str | None, gated: bool) -> bool:
    """Hopper, QuACK importable, bf16/fp16 operands, 16-byte aligned rows (TMA), an activation it has."""
    dims = (x.shape[1], w_in.shape[1], w_out.shape[1], w_out.shape[2])
    return (x.dtype in DTYPES and w_in.dtype == x.dtype and w_out.dtype == x.dtype
            and all(n * x.element_size() % 16 == 0 for n in dims)
            and (activation is None or (activation, gated) in ACTIVATIONS) and available(x.device))


def gemm_config(config: dict | None):
    """QuACK's GemmConfig from its fields (None: QuACK's default for the device)."""
    if config is None:
        return None
    from quack.gemm_config import GemmConfig

    return GemmConfig(**config)


def first_projection(x: torch.Tensor, cu_seqlens: torch.Tensor, w_in: torch.Tensor, b_in, activation: str,
                     gated: bool, gather_rows: torch.Tensor | None = None, interleaved: bool = False,
                     config: dict | None = None) -> torch.Tensor:
    """act(x[r] W_in[e]^T + b_in[e]) for the rows r of each expert e's group (gated: act(gate) * up, W_in's gate rows
    first, or alternating gate / up rows when interleaved). With gather_rows (int32, one per output row) row r reads
    x[gather_rows[r]] instead of x[r]. Output rows past the last group are left unwritten."""
    # QuACK sizes its varlen schedule from the pre-activation output unless it gathers: without a gather it is written
    return _first_projection(x, cu_seqlens, w_in, b_in, activation, gated, gather_rows, interleaved, config,
                             keep_preact=gather_rows is None)[0]


def first_projection_train(x: torch.Tensor, cu_seqlens: torch.Tensor, w_in: torch.Tensor, b_in, activation: str,
                           gated: bool, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(first_projection's output, h): h is the pre-activation x W_in^T + b_in as `backward` reads it (gated: gate
    and up columns alternating, the pairs QuACK's gated epilogues take)."""
    return _first_projection(x, cu_seqlens, w_in, b_in, activation, gated, None, False, config, keep_preact=True)


def _first_projection(x, cu_seqlens, w_in, b_in, activation, gated, gather_rows, interleaved, config, keep_preact):
    rows = gather_rows.shape[0] if gather_rows is not None else x.shape[0]
    width = w_in.shape[1] // 2 if gated else w_in.shape[1]
    out = x.new_empty(rows, width)
    preact = x.new_empty(rows, w_in.shape[1]) if keep_preact else None
    if rows == 0:
        return out, preact
    b = w_in.transpose(1, 2)
    act = ACTIVATIONS[(activation, gated)]
    if gated:
        concat = None if interleaved else ("B", "bias") if b_in is not None else ("B",)
        _quack().gemm_gated_tuned.fn(x, b, preact, out, None, b_in, act, cu_seqlens, gather_rows, False,
                                     config=gemm_config(config), concat_layout=concat)
    else:
        _quack().gemm_act_tuned.fn(x, b, preact, out, None, b_in, act, cu_seqlens, gather_rows, False,
                                   config=gemm_config(config))
    return out, preact


def second_projection(a: torch.Tensor, cu_seqlens: torch.Tensor, w_out: torch.Tensor, b_out,
                      config: dict | None = None) -> torch.Tensor:
    """a[r] W_out[e]^T + b_out[e] over each expert's group of rows; rows past the last group left unwritten."""
    out = a.new_empty(a.shape[0], w_out.shape[1])
    if a.shape[0] == 0:
        return out
    _quack().gemm_tuned.fn(a, w_out.transpose(1, 2), out, bias=b_out, cu_seqlens_m=cu_seqlens,
                           config=gemm_config(config))
    return out


def backward(grad_y: torch.Tensor, x: torch.Tensor, cu_seqlens: torch.Tensor, w_in: torch.Tensor,
             w_out: torch.Tensor, h: torch.Tensor, activation: str, gated: bool,
             configs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_w_in, grad_w_out, grad_h) of the experts given first_projection_train's h, in four QuACK GEMMs:
    grad_h = act'(h) * (grad_y W_out[e]) with the activation recomputed in the same epilogue, grad_w_out and grad_w_in
    as GEMMs over each group's rows (varlen K: an empty group's gradient is zero), grad_x = grad_h W_in[e]. grad_h
    is in h's layout; grad_x rows past the last group are left unwritten. configs: GemmConfig fields by GEMM name
    ("data", "weight_out", "weight_in", "input"); QuACK's default where a name is missing."""
    return _backward(grad_y, None, None, x, cu_seqlens, w_in, w_out, h, activation, gated, configs)[:4]


def combined_backward(grad_out: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor, x: torch.Tensor,
                      cu_seqlens: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, h: torch.Tensor,
                      activation: str, configs: dict | None = None) -> tuple[torch.Tensor, ...]:
    """backward() of gated experts whose output rows y were combined as out[t] = sum scores[r] * y[r] over the rows r
    with tokens[r] = t: grad_out is the combine's gradient [T, H], and the experts' row gradients
    scores[r] * grad_out[tokens[r]] are read through tokens inside the data and weight_out GEMMs, never written
    (tokens int32, scores float32, one per row). Returns backward()'s four and grad_scores [rows] float32 =
    <y[r], grad_out[tokens[r]]> (experts without an output bias), from the data GEMM's epilogue; rows past the last
    group unspecified."""
    return _backward(grad_out, tokens, scores, x, cu_seqlens, w_in, w_out, h, activation, True, configs)


def _backward(grad_y, tokens, scores, x, cu_seqlens, w_in, w_out, h, activation, gated, configs):
    configs = {name: gemm_config(config) for name, config in (configs or {}).items()}
    quack = _quack()
    grad_h = torch.empty_like(h)
    a = x.new_empty(x.shape[0], w_out.shape[2])
    grad_w_in, grad_w_out, grad_x = torch.empty_like(w_in), torch.empty_like(w_out), torch.empty_like(x)
    if x.shape[0] == 0:
        return grad_x, grad_w_in.zero_(), grad_w_out.zero_(), grad_h, torch.zeros(0, device=x.device)
    act = ACTIVATIONS[(activation, gated)]
    # combined: the row gradient scales grad_h and the kept activation a (weight_out's operand) in the epilogue,
    # which also sums a * (grad_out W_out) per row: the gradient of each row's score
    gather = {} if tokens is None else dict(A_idx=tokens)
    data = quack.gemm_dgated_tuned.fn if gated else quack.gemm_dact_tuned.fn
    scored = {} if tokens is None else dict(colvec_scale=scores, colvec_reduce=True)
    grad_scores = data(grad_y, w_out, h, grad_h, a, activation=act, cu_seqlens_m=cu_seqlens, dynamic_scheduler=False,
                       config=configs.get("data"), **gather, **scored)
    quack.gemm_tuned.fn(grad_y.t(), a, grad_w_out, cu_seqlens_k=cu_seqlens, config=configs.get("weight_out"),
                        **gather)
    # gated grad_h alternates gate / up columns; W_in and its gradient keep gate rows first (QuACK's concat layout)
    quack.gemm_tuned.fn(x.t(), grad_h, grad_w_in.transpose(1, 2), cu_seqlens_k=cu_seqlens,
                        concat_layout=("out",) if gated else None, config=configs.get("weight_in"))
    quack.gemm_tuned.fn(grad_h, w_in, grad_x, cu_seqlens_m=cu_seqlens, concat_layout=("B",) if gated else None,
                        config=configs.get("input"))
    return grad_x, grad_w_in, grad_w_out, grad_h, grad_scores


def concatenated_columns(t: torch.Tensor) -> torch.Tensor:
    """A gated tensor's columns from alternating gate / up pairs (h's layout) to gate columns first."""
    return t.unflatten(-1, (t.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)
