"""The public home of MoECompileError (defined in the leaf moecompile.core.errors)."""
from moecompile.core.errors import MoECompileError

__all__ = ["MoECompileError"]
