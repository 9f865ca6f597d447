"""moecompile: turn dense or MoE models into Mixture-of-Experts graphs and run them fast.

    import moecompile
    result = moecompile.convert("path/to/llama", "llama-moe8", experts=8, top_k=2)  # a folder in, a folder out
    model = moecompile.moeize(model, experts=16, top_k=2, method="upcycle")
    moecompile.save(model, "gpt2-moe16")
    model = moecompile.load("gpt2-moe16")
    moecompile.export_onnx(model, "gpt2-moe16.onnx")

Importing the package is cheap (the CLI answers --help without torch): each public name is imported on first use,
the moecompile:: custom ops are registered as soon as torch is imported, and the Hugging Face experts
implementation ("moecompile") as soon as transformers' MoE integration is.
"""
import importlib
import importlib.machinery as _machinery
import sys
from pathlib import Path as _Path

import wrapt

# A source checkout keeps the subpackages kernels/, passes/, runtime/ and examples/ beside this folder (pyproject's
# package-dir). They are namespace folders (no __init__.py), so from the checkout's root they never shadow a
# top-level package of the same name, such as Hugging Face's `kernels`; an installed wheel holds them inside.
_CHECKOUT_FOLDERS = ("kernels", "passes", "runtime", "examples")
_checkout = _Path(__file__).resolve().parent.parent


class _CheckoutFolders:
    """Finds moecompile.<folder> for exactly those folders of a source checkout (tests/ and bench/ stay outside)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        package, _, folder = name.partition(".")
        if package != __name__ or folder not in _CHECKOUT_FOLDERS:
            return None
        return _machinery.PathFinder.find_spec(name, [str(_checkout)])  # the folder as a namespace package


if not (_Path(__file__).parent / "kernels").is_dir() and (_checkout / "kernels").is_dir():
    sys.meta_path.insert(0, _CheckoutFolders)

_PUBLIC = {  # name -> module that defines it
    "MoEBlock": "moecompile.ir.block", "MoEExperts": "moecompile.ir.block", "aux_loss": "moecompile.ir.block",
    "MoEConfig": "moecompile.ir.config", "MoEExpertsFP8": "moecompile.ir.fp8", "quantize_fp8": "moecompile.ir.fp8",
    "MoECompileError": "moecompile.errors", "compile": "moecompile.backend",
    "moeize": "moecompile.conversion.in_memory", "convert": "moecompile.conversion.api",
    "ConvertOptions": "moecompile.conversion.api", "ConversionResult": "moecompile.conversion.api",
    "load": "moecompile.io.checkpoint", "save": "moecompile.io.checkpoint",
    "export_onnx": "moecompile.io.onnx_export", "distribute": "moecompile.parallel.sharded",
    "RoutingStats": "moecompile.stats", "routing_metrics": "moecompile.stats", "routing_stats": "moecompile.stats",
    "track_routing": "moecompile.stats", "generate": "moecompile.generation", "Generator": "moecompile.generation",
}
_RENAMED = {"quantize_fp8": "quantize"}
_MODULES = {"ops": "moecompile.ir.ops"}

__all__ = sorted([*_PUBLIC, *_MODULES])
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    elif name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), _RENAMED.get(name, name))
    else:
        raise AttributeError(f"module 'moecompile' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *__all__])


@wrapt.when_imported("torch")
def _register_ops(_torch):
    # not from inside the import of one of our modules (torch imported by ops' own dependencies): that import
    # chain is half done, and whatever needs the ops imports them itself
    if not any(getattr(getattr(m, "__spec__", None), "_initializing", False)
               for name, m in list(sys.modules.items()) if name.startswith("moecompile.")):
        importlib.import_module("moecompile.ir.ops")


@wrapt.when_imported("transformers.integrations.moe")
def _register_hf_experts(_module):
    importlib.import_module("moecompile.integrations.hf_experts").register()
