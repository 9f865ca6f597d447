"""moecompile: turn dense or MoE models into Mixture-of-Experts graphs and run them fast.

    import moecompile
    model = moecompile.moeize(model, experts=16, top_k=2, method="upcycle")
    moecompile.save(model, "gpt2-moe16")
    model = moecompile.load("gpt2-moe16")
"""
from . import ops  # registers the moecompile:: custom ops
from .block import MoEBlock, MoEExperts, aux_loss
from .checkpoint import load, save
from .config import MoEConfig
from .convert import moeize
from .errors import MoECompileError
from .fp8 import MoEExpertsFP8
from .fp8 import quantize as quantize_fp8

__all__ = ["MoEBlock", "MoEExperts", "MoEExpertsFP8", "MoEConfig", "MoECompileError", "aux_loss", "load", "moeize",
           "ops", "quantize_fp8", "save"]
__version__ = "0.1.0"
