"""The IR every layer shares: the moecompile:: ops, MoEConfig, the MoEBlock module view, activation and FP8 definitions."""
