"""Leaf kernels for the moecompile ops: torch (and later triton) only, no moecompile imports."""
