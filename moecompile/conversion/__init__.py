"""Dense -> MoE conversion: capture the model, find its FFNs, build expert blocks from their weights."""
