"""vLLM's fused_moe Triton GEMMs as a layer-level benchmark peer, built from vLLM's own source fetched at run time.

Where the source comes from: the vllm 0.34.0 sdist on PyPI (SDIST_URL, checked against SDIST_SHA256). `fetch`
extracts only vllm/model_executor/layers/fused_moe/fused_moe.py, the tuned configs
configs/E=*,N=*,device_name=NVIDIA_H200*.json (about 220 KB) and vLLM's LICENSE into .peers/vllm/ at the repository
root, which .gitignore keeps out of git. vLLM is Apache-2.0 licensed; none of its code is committed here.

fused_moe.py imports much of vLLM, so it is never imported: `load` cuts the two @triton.jit functions
(`write_zeros_to_output` and `fused_moe_kernel`) out of it with `ast`, by name, writes them with `import triton` and
`import triton.language as tl` (all they reference besides builtins) to .peers/vllm/_vllm_fused_moe_kernels.py and
imports that file (Triton reads a kernel's source through `inspect`, so it has to live in a file). The torch glue
below (alignment, config lookup, the two launches, activation, sum) is ours and mirrors vLLM's fused_experts_impl
for unquantized bf16/fp16/fp32 weights without expert parallelism.

The GPU machine has no network; fetch on this machine and carry the folder:
    python bench/peers/vllm_fused_moe.py --fetch      # downloads ~50 MB once, keeps ~0.3 MB in .peers/vllm
    run(..., carry=[".peers"])                        # then, on the H200:
    python bench/peers/vllm_fused_moe.py --check      # CPU interpreter check (fp32) + CUDA check (bf16)

API (w1 [E, 2N, K] with the gate rows first, then the up rows, as HF Mixtral's gate_up_proj; w2 [E, K, N]):
    fetch(dest, sdist=None) -> Path; load(dest) -> kernels module; config_for(M, E, N, dest) -> dict;
    align(topk_ids, block_m, num_experts) -> (sorted_token_ids, expert_ids, num_tokens_post_padded);
    fused_moe(x, w1, w2, topk_weights, topk_ids, config=None) -> [T, K];
    prepare(...) -> FusedMoE with .gemms() and .layer() for timing (what each times: see FusedMoE).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import torch

VLLM_VERSION = "0.34.0"
SDIST_URL = ("https://files.pythonhosted.org/packages/92/21/6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff/"
             f"vllm-{VLLM_VERSION}.tar.gz")
SDIST_SHA256 = "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"
REPO = Path(__file__).resolve().parents[2]
DEFAULT_DEST = REPO / ".peers" / "vllm"
_MOE_DIR = f"vllm-{VLLM_VERSION}/vllm/model_executor/layers/fused_moe/"
_KERNEL_NAMES = ("write_zeros_to_output", "fused_moe_kernel")
# fused_moe_kernel's parameters in vLLM 0.34.0; load() refuses a source whose signature differs from this
_KERNEL_PARAMS = (
    "a_ptr", "b_ptr", "b_desc", "c_ptr", "b_bias_ptr", "a_scale_ptr", "b_scale_ptr", "topk_weights_ptr",
    "sorted_token_ids_ptr", "expert_ids_ptr", "num_tokens_post_padded_ptr", "a_desc", "N", "K", "EM",
    "num_valid_tokens", "stride_am", "stride_ak", "stride_be", "stride_bk", "stride_bn", "stride_cm", "stride_cn",
    "stride_asm", "stride_ask", "stride_bse", "stride_bsk", "stride_bsn", "stride_bbe", "stride_bbn", "group_n",
    "group_k", "naive_block_assignment", "BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "SPLIT_K",
    "MUL_ROUTED_WEIGHT", "top_k", "compute_type", "use_fp8_w8a8", "use_int8_w8a8", "use_int8_w8a16",
    "per_channel_quant", "HAS_BIAS", "SWAP_AB", "USE_TD", "USE_TMA_B", "USE_TMA_A", "C_IS_SORTED")


class PeerUnavailable(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------------------- fetch
def _complete(dest: Path) -> bool:
    return (dest / "fused_moe.py").is_file() and (dest / "MANIFEST.json").is_file() and any(
        (dest / "configs").glob("*NVIDIA_H200*.json"))


def _wanted(name: str) -> str | None:
    """The path under dest for a member of the sdist that we keep, else None."""
    if name == f"vllm-{VLLM_VERSION}/LICENSE":
        return "LICENSE"
    if name == _MOE_DIR + "fused_moe.py":
        return "fused_moe.py"
    if name.startswith(_MOE_DIR + "configs/") and "NVIDIA_H200" in name and name.endswith(".json"):
        base = name.rsplit("/", 1)[1]
        return None if "/" in base or base.startswith(".") else "configs/" + base
    return None


def fetch(dest: Path = DEFAULT_DEST, sdist: Path | str | None = None, url: str = SDIST_URL) -> Path:
    """Make dest hold vLLM's fused_moe.py and its H200 configs; download the sdist only when they are missing.

    sdist (or $VLLM_SDIST): a local copy of the tarball to use instead of downloading; its sha256 is checked too.
    """
    dest = Path(dest)
    if _complete(dest):
        return dest
    sdist = sdist or os.environ.get("VLLM_SDIST")
    tmp_dl = None
    try:
        if sdist is None:
            fd, tmp_dl = tempfile.mkstemp(suffix=".tar.gz")
            os.close(fd)
            try:
                with urllib.request.urlopen(url, timeout=60) as r, open(tmp_dl, "wb") as f:
                    shutil.copyfileobj(r, f, 1 << 20)
            except (urllib.error.URLError, OSError) as e:
                raise PeerUnavailable(
                    f"no vLLM fused_moe source: {dest} lacks it and downloading {url} failed "
                    f"({getattr(e, 'reason', e)}); run `python bench/peers/vllm_fused_moe.py --fetch` on a machine "
                    "with network and carry .peers") from None
            sdist = tmp_dl
        h = hashlib.sha256()
        with open(sdist, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != SDIST_SHA256:
            raise PeerUnavailable(f"{sdist}: sha256 {h.hexdigest()} is not vllm-{VLLM_VERSION}'s {SDIST_SHA256}")
        staging = Path(tempfile.mkdtemp(prefix=".vllm-", dir=dest.parent if dest.parent.exists() else None))
        kept = []
        with tarfile.open(sdist, "r:gz") as tar:
            for m in tar:
                rel = _wanted(m.name) if m.isfile() else None
                if rel is None:
                    continue
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                (staging / rel).write_bytes(tar.extractfile(m).read())
                kept.append(rel)
        if "fused_moe.py" not in kept:
            raise PeerUnavailable(f"{sdist} has no {_MOE_DIR}fused_moe.py")
        (staging / "MANIFEST.json").write_text(json.dumps(
            {"vllm": VLLM_VERSION, "url": url, "sha256": SDIST_SHA256, "files": sorted(kept)}, indent=1))
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            shutil.rmtree(dest)
        staging.chmod(0o755)
        staging.rename(dest)
        return dest
    finally:
        if tmp_dl is not None:
            os.unlink(tmp_dl)


# ----------------------------------------------------------------------------------------------------------- load
_LOADED: dict = {}


def kernel_source(fused_moe_py: Path) -> str:
    """The source of a module holding just vLLM's two jitted functions (cut out by name with ast)."""
    text = Path(fused_moe_py).read_text()
    lines = text.splitlines(keepends=True)
    found = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name in _KERNEL_NAMES:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            found[node.name] = (node, "".join(lines[start - 1:node.end_lineno]))
    missing = [n for n in _KERNEL_NAMES if n not in found]
    if missing:
        raise PeerUnavailable(f"{fused_moe_py}: no function {missing}")
    params = tuple(a.arg for a in found["fused_moe_kernel"][0].args.args)
    if params != _KERNEL_PARAMS:
        raise PeerUnavailable(f"{fused_moe_py}: fused_moe_kernel's signature is not vLLM {VLLM_VERSION}'s; "
                              "the glue in this module would pass the wrong arguments")
    head = (f"# Generated by bench/peers/vllm_fused_moe.py from vLLM {VLLM_VERSION}'s fused_moe.py "
            "(Apache-2.0, see LICENSE here). Not part of moecompile.\nimport triton\nimport triton.language as tl\n")
    return head + "".join("\n\n" + found[n][1] for n in _KERNEL_NAMES)


def load(dest: Path = DEFAULT_DEST):
    """The module holding vLLM's `fused_moe_kernel` (and `write_zeros_to_output`), imported without vLLM."""
    dest = Path(dest)
    if not (dest / "fused_moe.py").is_file():
        raise PeerUnavailable(f"{dest / 'fused_moe.py'} missing: run `python bench/peers/vllm_fused_moe.py --fetch`")
    src = kernel_source(dest / "fused_moe.py")
    key = (str(dest.resolve()), src, os.environ.get("TRITON_INTERPRET", ""))
    if key in _LOADED:
        return _LOADED[key]
    path = dest / "_vllm_fused_moe_kernels.py"
    try:
        if not path.is_file() or path.read_text() != src:
            path.write_text(src)
    except OSError:  # a read-only carried folder
        path = Path(tempfile.mkdtemp()) / "_vllm_fused_moe_kernels.py"
        path.write_text(src)
    name = f"_vllm_fused_moe_kernels_{hashlib.sha1(repr(key).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    _LOADED[key] = mod
    return mod


# ---------------------------------------------------------------------------------------------------------- align
def align(topk_ids: torch.Tensor, block_m: int, num_experts: int):
    """vLLM's moe_align_block_size (no expert map), in torch and without host synchronisation.

    Returns sorted_token_ids (int32, [max_padded]): the flat assignment ids t*k+j grouped by expert, each expert's
    group padded to a multiple of block_m with the sentinel T*k; expert_ids (int32, [cdiv(max_padded, block_m)]):
    the expert of each block (-1 past the used blocks, which the kernel never reads); num_tokens_post_padded (int32,
    [1]): the used length. max_padded is vLLM's T*k + E*(block_m-1), capped at T*k*block_m when T*k < E. Within an
    expert the ids are in increasing order (vLLM's CUDA op does not promise an order; the kernel does not care).
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    n, dev = flat.numel(), flat.device
    max_padded = n + num_experts * (block_m - 1)
    if n < num_experts:
        max_padded = min(n * block_m, max_padded)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[e_sorted]
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, (ends - padded)[e_sorted] + rank, order.to(torch.int32))
    starts = torch.arange(0, max_padded, block_m, device=dev)
    expert_ids = torch.searchsorted(ends, starts, right=True, out_int32=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


# --------------------------------------------------------------------------------------------------------- config
def default_config(M: int, E: int) -> dict:
    """vLLM 0.34.0's get_default_config for bf16/fp16 on CUDA (used when no tuned file exists)."""
    block_m = 16 if M <= 32 else 32 if M <= 96 else 64 if M <= 512 else 128
    return {"BLOCK_SIZE_M": block_m, "BLOCK_SIZE_N": 64 if M <= 64 else 128, "BLOCK_SIZE_K": 128 if M <= 64 else 64,
            "GROUP_SIZE_M": 16 if M // max(E, 1) > 128 else 1, "num_warps": 4 if M <= 128 else 8,
            "num_stages": 4 if M <= 32 else 3}


def config_file(E: int, N: int, dest: Path = DEFAULT_DEST, device_name: str = "NVIDIA_H200") -> Path:
    return Path(dest) / "configs" / f"E={E},N={N},device_name={device_name}.json"


def config_for(M: int, E: int, N: int, dest: Path = DEFAULT_DEST, device_name: str = "NVIDIA_H200") -> dict:
    """vLLM's config for M tokens (not M*k), E experts and intermediate size N (w2.shape[2]), as
    try_get_optimal_moe_config picks it: the tuned entry whose key is closest to M (the smaller key on a tie), else
    the default. The same config serves both GEMMs, as in vLLM. An entry records its source under "_source"."""
    path = config_file(E, N, dest, device_name)
    if path.is_file():
        table = json.loads(path.read_text())
        table.pop("triton_version", None)
        table = {int(k): v for k, v in table.items()}
        key = min(table, key=lambda x: abs(x - M))
        return dict(table[key], _source=f"{path.name}[{key}]")
    return dict(default_config(M, E), _source="default")


# --------------------------------------------------------------------------------------------------------- launch
def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def launch(kern, A, B, C, topk_weights, sorted_ids, expert_ids, num_post_padded, mul_routed_weight: bool,
           top_k: int, config: dict, compute_type):
    """One fused_moe_kernel launch with the arguments vLLM's invoke_fused_moe_triton_kernel passes for unquantized
    weights (no bias, no TMA/tensor descriptors, no swap-AB, SPLIT_K 1). A [rows, K], B [E, N, K], C [rows*top_k, N]
    indexed by the flat assignment id; sorted_ids None: vLLM's naive one-assignment-per-block path."""
    cfg = {k: v for k, v in config.items() if not k.startswith("_") and k != "USE_TMA"}
    cfg["SPLIT_K"] = 1
    bm, bn = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"]
    num_tokens = A.size(0) * top_k
    if sorted_ids is not None:
        em = sorted_ids.size(0)
        if A.size(0) < bm:  # vLLM's small-batch cap on the grid
            em = min(em, A.size(0) * top_k * bm)
    else:
        em = num_tokens * bm
    grid = (-(-em // bm) * -(-B.size(1) // bn),)
    kern[grid](
        a_ptr=A, b_ptr=B, b_desc=None, c_ptr=C, b_bias_ptr=None, a_scale_ptr=None, b_scale_ptr=None,
        topk_weights_ptr=topk_weights, sorted_token_ids_ptr=sorted_ids, expert_ids_ptr=expert_ids,
        num_tokens_post_padded_ptr=num_post_padded, a_desc=None,
        N=B.size(1), K=B.size(2), EM=em, num_valid_tokens=num_tokens,
        stride_am=A.stride(0), stride_ak=A.stride(1), stride_be=B.stride(0), stride_bk=B.stride(2),
        stride_bn=B.stride(1), stride_cm=C.stride(0), stride_cn=C.stride(1),
        stride_asm=0, stride_ask=0, stride_bse=0, stride_bsk=0, stride_bsn=0, stride_bbe=0, stride_bbn=0,
        group_n=0, group_k=0, naive_block_assignment=sorted_ids is None,
        MUL_ROUTED_WEIGHT=mul_routed_weight, top_k=top_k, compute_type=compute_type,
        use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False,
        HAS_BIAS=False, SWAP_AB=False, USE_TD=False, USE_TMA_B=False, USE_TMA_A=False, C_IS_SORTED=False,
        **cfg)


class FusedMoE:
    """vLLM's fused_experts for one routed batch, with buffers allocated once. What the two timing entries cover:

    gemms(): just the two fused_moe_kernel launches: gate/up GEMM (x rows gathered through sorted_token_ids into
      cache1 [T*k, 2N]) and down GEMM (reads cache2 [T*k, N], multiplies by the routing weight, writes cache3
      [T*k, K]). The alignment was computed in __init__ and cache2 holds the activation of the first layer() run, so
      routing, align, activation and the sum over k are all excluded. This is what "GEMMs alone" means.
    layer(): the whole layer after routing: align (torch, ~10 small kernels where vLLM runs one CUDA op; or the naive
      assignment vLLM uses when T*k*4 <= E), both GEMMs, silu(gate)*up (torch, 2 kernels where vLLM's silu_and_mul
      is one) and the sum over k (torch, where vLLM runs moe_sum). Excludes the router (softmax/top-k, its input)
      and the config lookup. Returns self.out [T, K] (reused between calls).
    Both are free of host synchronisation and run on static buffers, so they can be captured in a CUDA graph
    (cuda_graph below); uncaptured, each Triton launch carries its Python launch cost (tens of microseconds).
    """

    def __init__(self, x, w1, w2, topk_weights, topk_ids, config: dict | None = None, naive: bool | None = None,
                 dest: Path = DEFAULT_DEST):
        T, K = x.shape
        E, two_n, K1 = w1.shape
        assert K1 == K and w2.shape == (E, K, two_n // 2), (x.shape, w1.shape, w2.shape)
        assert x.is_contiguous() and w1.stride(-1) == 1 and w2.stride(-1) == 1
        assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == T
        self.x, self.w1, self.w2, self.topk_ids = x, w1, w2, topk_ids
        self.E, self.N, self.k = E, two_n // 2, topk_ids.shape[1]
        self.topk_weights = topk_weights.reshape(-1).contiguous()
        self.config = dict(config) if config is not None else config_for(T, E, self.N, dest)
        self.naive = T * self.k * 4 <= E if naive is None else naive  # vLLM's rule (no expert map)
        self.kern = load(dest).fused_moe_kernel
        self.compute_type = _tl_dtype(x.dtype)
        self.cache1 = torch.empty(T * self.k, two_n, dtype=x.dtype, device=x.device)
        self.cache2 = torch.empty(T * self.k, self.N, dtype=x.dtype, device=x.device)
        self.cache3 = torch.empty(T * self.k, K, dtype=x.dtype, device=x.device)
        self.out = torch.empty(T, K, dtype=x.dtype, device=x.device)
        self.aligned = self._align()

    def _align(self):
        if self.naive:  # vLLM's _prepare_expert_assignment, naive branch
            return (None, self.topk_ids.reshape(-1),
                    torch.full((1,), self.topk_ids.numel() * self.config["BLOCK_SIZE_M"], dtype=torch.int32,
                               device=self.x.device))
        return align(self.topk_ids, self.config["BLOCK_SIZE_M"], self.E)

    def _gemm1(self, aligned):
        launch(self.kern, self.x, self.w1, self.cache1, self.topk_weights, *aligned, False, self.k, self.config,
               self.compute_type)

    def _gemm2(self, aligned):
        launch(self.kern, self.cache2, self.w2, self.cache3, self.topk_weights, *aligned, True, 1, self.config,
               self.compute_type)

    def gemms(self) -> None:
        self._gemm1(self.aligned)
        self._gemm2(self.aligned)

    def layer(self) -> torch.Tensor:
        aligned = self._align()
        self._gemm1(aligned)
        torch.mul(torch.nn.functional.silu(self.cache1[:, :self.N]), self.cache1[:, self.N:], out=self.cache2)
        self._gemm2(aligned)
        torch.sum(self.cache3.view(-1, self.k, self.cache3.shape[1]), dim=1, out=self.out)
        return self.out

    def flops(self) -> int:
        """Useful FLOPs of the two GEMMs (the project's 6 * tokens * k * d * f)."""
        return 6 * self.x.shape[0] * self.k * self.x.shape[1] * self.N


def prepare(x, w1, w2, topk_weights, topk_ids, config: dict | None = None, naive: bool | None = None,
            dest: Path = DEFAULT_DEST) -> FusedMoE:
    """A FusedMoE after one layer() run (compiles the kernel for this config and fills cache2 for gemms())."""
    m = FusedMoE(x, w1, w2, topk_weights, topk_ids, config, naive, dest)
    m.layer()
    return m


def fused_moe(x, w1, w2, topk_weights, topk_ids, config: dict | None = None, naive: bool | None = None,
              dest: Path = DEFAULT_DEST) -> torch.Tensor:
    """vLLM's fused_experts (silu, no quantisation): x [T, K], w1 [E, 2N, K] gate rows then up rows, w2 [E, K, N],
    topk_weights/topk_ids [T, k] -> [T, K]. config: vLLM's tuned config for T when None."""
    return FusedMoE(x, w1, w2, topk_weights, topk_ids, config, naive, dest).layer()


def cuda_graph(fn, warmup: int = 2):
    """Capture fn (e.g. FusedMoE.layer or .gemms) in a CUDA graph; returns the graph's replay."""
    from moecompile.runtime import graphs

    return graphs.capture(fn, warmup)[0].replay


# ---------------------------------------------------------------------------------------------------------- check
def reference(x, w1, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Plain torch, token by token, in float32 on the given (already rounded) values."""
    N = w2.shape[2]
    w1f, w2f = w1.float(), w2.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        xt = x[t].float()
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = w1f[e] @ xt
            out[t] += float(topk_weights[t, j]) * (w2f[e] @ (torch.nn.functional.silu(h[:N]) * h[N:]))
    return out


def _errors(out, ref) -> tuple[float, float]:
    d = (out.float() - ref).abs()
    return float(d.max() / ref.abs().max()), float(torch.linalg.norm(d) / torch.linalg.norm(ref))


def _check_align(seed: int = 0) -> bool:
    g = torch.Generator().manual_seed(seed)
    ok = True
    for T, k, E, bm in [(5, 2, 4, 16), (1, 2, 8, 16), (37, 3, 6, 4), (64, 8, 128, 16), (3, 1, 2, 1)]:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        s, b, npp = align(ids, bm, E)
        flat, n = ids.reshape(-1), T * k
        counts = torch.bincount(flat, minlength=E)
        want = int(((counts + bm - 1) // bm * bm).sum())
        used = s[:want]
        good = (npp.tolist() == [want] and s.dtype == b.dtype == npp.dtype == torch.int32
                and sorted(used[used < n].tolist()) == list(range(n)) and bool((s[want:] == n).all())
                and want % bm == 0 and b.numel() * bm >= s.numel())
        for blk in range(want // bm):
            ids_b = used[blk * bm:(blk + 1) * bm]
            ids_b = ids_b[ids_b < n].long()
            good = good and ids_b.numel() > 0 and bool((flat[ids_b] == b[blk]).all())
        ok &= good
        print(f"align T={T} k={k} E={E} block_m={bm}: {'ok' if good else 'MISMATCH'}")
    return ok


def _case(T, K, N, E, k, config, dtype, device, seed, tol, naive=None, dest=DEFAULT_DEST, graph=False) -> bool:
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(device, dtype)
    w1 = (torch.randn(E, 2 * N, K, generator=g) / K ** 0.5).to(device, dtype)
    w2 = (torch.randn(E, K, N, generator=g) / N ** 0.5).to(device, dtype)
    logits = torch.randn(T, E, generator=g)
    topk_weights, topk_ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    topk_weights, topk_ids = topk_weights.to(device), topk_ids.to(device)
    m = FusedMoE(x, w1, w2, topk_weights, topk_ids, config, naive, dest)
    out = m.layer().clone()
    ref = reference(x, w1, w2, topk_weights, topk_ids)
    mx, fro = _errors(out, ref)
    ok = mx <= tol and fro <= tol
    c3 = m.cache3.clone()  # gemms() on the prepared alignment reproduces the layer's cache3
    m.cache3.zero_()
    m.gemms()
    ok &= torch.equal(m.cache3, c3)
    extra = f", gemms() {'same' if torch.equal(m.cache3, c3) else 'DIFFERENT'}"
    if graph:
        replay = cuda_graph(m.layer)
        m.out.zero_()
        replay()
        torch.cuda.synchronize()
        same = torch.equal(m.out, out)
        ok &= same
        extra += f", CUDA graph replay {'same' if same else 'DIFFERENT'}"
    cfg = {k_: v for k_, v in m.config.items() if k_ != "_source"}
    print(f"{device} {str(dtype).removeprefix('torch.')} T={T} K={K} N={N} E={E} k={k} "
          f"{'naive' if m.naive else 'aligned'} {m.config.get('_source', 'given')} {cfg}: "
          f"max|err|/max|ref| {mx:.2e}, rel Frobenius {fro:.2e} (tol {tol:.0e}){extra} -> {'ok' if ok else 'MISMATCH'}")
    return ok


def check_cpu(dest: Path = DEFAULT_DEST) -> bool:
    """Triton interpreter, float32 (its tl.dot on bf16 is wrong), tiny grids (~35 ms a program instance)."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    small = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 16, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 1, "num_warps": 1,
             "num_stages": 1}
    ok = _check_align()
    ok &= _case(5, 32, 16, 4, 2, small, torch.float32, "cpu", 0, 1e-4, dest=dest)
    ok &= _case(1, 32, 16, 8, 2, small, torch.float32, "cpu", 1, 1e-4, dest=dest)  # naive: 1*2*4 <= 8
    ok &= _case(7, 40, 24, 3, 2, dict(small, BLOCK_SIZE_N=32, GROUP_SIZE_M=2), torch.float32, "cpu", 2, 1e-4,
                dest=dest)  # K and 2N not multiples of the blocks, grouped pid order
    return ok


def check_cuda(dest: Path = DEFAULT_DEST) -> bool:
    """bf16 with vLLM's H200 configs on Mixtral's and Qwen3-MoE's expert shapes, against a float32 reference."""
    ok = True
    for T in (1, 64, 300):  # T=1: naive assignment (2*4 <= 8); 64 and 300: tuned entries 64 and 256
        ok &= _case(T, 4096, 14336, 8, 2, None, torch.bfloat16, "cuda", 10 + T, 2e-2, dest=dest, graph=T == 64)
    ok &= _case(100, 2048, 768, 128, 8, None, torch.bfloat16, "cuda", 7, 2e-2, dest=dest, graph=True)
    ok &= _case(33, 512, 200, 5, 2, None, torch.bfloat16, "cuda", 8, 2e-2, dest=dest)  # no tuned file: default
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fetch", action="store_true", help="download/extract vLLM's sources into --dest")
    p.add_argument("--check", action="store_true", help="CPU interpreter check (subprocess) and, with CUDA, bf16")
    p.add_argument("--check-cpu", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    p.add_argument("--sdist", type=Path, help="a local copy of the vllm sdist instead of downloading")
    a = p.parse_args(argv)
    try:
        if a.fetch:
            d = fetch(a.dest, a.sdist)
            print(f"{d}: {json.loads((d / 'MANIFEST.json').read_text())['vllm']}, "
                  f"{sum(f.stat().st_size for f in d.rglob('*') if f.is_file()) // 1024} KB")
        if a.check_cpu:
            return 0 if check_cpu(a.dest) else 1
        if a.check:
            fetch(a.dest, a.sdist)
            env = dict(os.environ, TRITON_INTERPRET="1")  # read when triton is imported: a fresh process
            cmd = [sys.executable, __file__, "--check-cpu", "--dest", str(a.dest)]
            ok = subprocess.run(cmd, env=env).returncode == 0
            if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
                ok &= check_cuda(a.dest)
            else:
                print("no CUDA device: only the interpreter check ran (the H200 run is the authoritative one)")
            print("check:", "ok" if ok else "FAILED")
            return 0 if ok else 1
    except PeerUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
