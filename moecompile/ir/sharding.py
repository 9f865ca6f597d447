"""How expert parallelism shards a block: the rule the expert-parallel runtime and its checkpoints share."""
from __future__ import annotations

from moecompile.core.errors import MoECompileError

EXPERT_TENSORS = ("w_in", "b_in", "w_out", "b_out")  # MoEExperts' parameters, sharded on their first dim


def local_experts(num_experts: int, world_size: int) -> int:
    """Experts per rank; E must be a multiple of W (no rank holds a fraction of an expert)."""
    if num_experts % world_size:
        why = "fewer experts than ranks" if num_experts < world_size else "experts not divisible by ranks"
        raise MoECompileError(f"expert parallelism needs the number of experts to be a multiple of the number of "
                              f"ranks ({why}: {num_experts} experts over {world_size} ranks); use a process group "
                              f"whose size divides {num_experts}")
    return num_experts // world_size
