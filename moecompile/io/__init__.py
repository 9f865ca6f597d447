"""Reading and writing: checkpoints (single-folder, expert-parallel, Hugging Face FP8) and ONNX export."""
