"""Expert parallelism on torch.distributed: process groups (groups.py), the all-to-all data path and its op
(all_to_all.py), sharded blocks with DTensor / FSDP2 wiring (sharded.py), expert-parallel and DCP checkpoints
(save_load.py, dcp.py). The public API is re-exported by moecompile.distributed."""
