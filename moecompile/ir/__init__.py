"""The IR every layer shares: the moecompile:: ops, MoEConfig, the MoEBlock module view, activations, FP8 formats."""
