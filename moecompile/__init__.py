"""moecompile: turn dense or MoE models into Mixture-of-Experts graphs and run them fast.

    import moecompile
    model = moecompile.moeize(model, experts=16, top_k=2, method="upcycle")
    moecompile.save(model, "gpt2-moe16")
    model = moecompile.load("gpt2-moe16")
    moecompile.export_onnx(model, "gpt2-moe16.onnx")
"""
from . import hf, ops  # ops registers the moecompile:: custom ops
from .backend import compile
from .block import MoEBlock, MoEExperts, aux_loss
from .checkpoint import load, save
from .config import MoEConfig
from .convert import moeize
from .distributed import distribute
from .errors import MoECompileError
from .fp8 import MoEExpertsFP8
from .fp8 import quantize as quantize_fp8
from .onnx_export import export_onnx  # onnx / onnxscript imported on first use
from .stats import RoutingStats, routing_metrics, routing_stats, track_routing

__all__ = ["MoEBlock", "MoEExperts", "MoEExpertsFP8", "MoEConfig", "MoECompileError", "RoutingStats", "aux_loss",
           "compile", "distribute", "export_onnx", "load", "moeize", "ops", "quantize_fp8", "routing_metrics",
           "routing_stats", "save", "track_routing"]
__version__ = "0.1.0"

hf.register()  # model.set_experts_implementation("moecompile") for every HF MoE model
