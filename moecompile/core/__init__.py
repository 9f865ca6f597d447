"""Leaf definitions every layer may import (activations, the FP8 format, errors, router logits, settings); torch and
the standard library only, nothing else of moecompile."""
