"""moecompile: turn dense or MoE models into Mixture-of-Experts graphs and run them fast.

    import moecompile
    model = moecompile.moeize(model, experts=16, top_k=2, method="upcycle")
    moecompile.save(model, "gpt2-moe16")
    model = moecompile.load("gpt2-moe16")
    moecompile.export_onnx(model, "gpt2-moe16.onnx")
"""
from . import ops  # registers the moecompile:: custom ops
from .block import MoEBlock, MoEExperts, aux_loss
from .checkpoint import load, save
from .config import MoEConfig
from .convert import moeize
from .errors import MoECompileError
from .onnx_export import export_onnx  # onnx / onnxscript imported on first use

__all__ = ["MoEBlock", "MoEExperts", "MoEConfig", "MoECompileError", "aux_loss", "export_onnx", "load", "moeize", "ops",
           "save"]
__version__ = "0.1.0"
