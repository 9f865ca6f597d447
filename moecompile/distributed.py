"""Expert parallelism on torch.distributed: each rank holds E/W experts and tokens cross ranks by all-to-all.

    import moecompile, moecompile.distributed as ep
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    ep.init()                                  # torchrun's env; gloo on CPU, NCCL on CUDA; clear error on timeout
    mesh = init_device_mesh("cpu", (dp, ep_size), mesh_dim_names=("dp", "ep"))
    moecompile.distribute(model, mesh["ep"])   # in place: every MoEBlock keeps E/W experts, DTensors on mesh["ep"]
    ep.apply_fsdp(model, mesh)                 # experts: fully_shard over "dp"; the rest over dp x ep
    loss.backward()                            # no hand-written gradient sync
    optimizer.step()

The implementation lives in moecompile.parallel; this module is its documented public face.
"""
from moecompile.ir.sharding import EXPERT_TENSORS, local_experts
from moecompile.parallel.all_to_all import expert_parallel_experts, trace_expert_parallel
from moecompile.parallel.groups import DEFAULT_TIMEOUT_S, init
from moecompile.parallel.save_load import load, save
from moecompile.parallel.sharded import (
    PARALLEL_MODES,
    ExpertParallelExperts,
    ExpertParallelMoEBlock,
    all_reduce_gradients,
    apply_fsdp,
    data_parallel_mesh,
    data_parallel_parameters,
    distribute,
    expert_parameters,
    is_distributed,
    local_tensor,
    parallel_mode,
)

__all__ = ["DEFAULT_TIMEOUT_S", "EXPERT_TENSORS", "PARALLEL_MODES", "ExpertParallelExperts", "ExpertParallelMoEBlock",
           "all_reduce_gradients", "apply_fsdp", "data_parallel_mesh", "data_parallel_parameters", "distribute",
           "expert_parallel_experts", "expert_parameters", "init", "is_distributed", "load", "local_experts",
           "local_tensor", "parallel_mode", "save", "trace_expert_parallel"]
