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
from .distributed import distribute
from .errors import MoECompileError

__all__ = ["MoEBlock", "MoEExperts", "MoEConfig", "MoECompileError", "aux_loss", "distribute", "load", "moeize", "ops",
           "save"]
__version__ = "0.1.0"
