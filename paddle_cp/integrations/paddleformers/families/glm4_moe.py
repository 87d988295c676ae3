"""GLM4-MoE: listed experts, an expert no token reached not run; `shared_experts` is its dense part."""
import paddle_cp as pcp

BLOCK = pcp.BlockKind(("Glm4MoeMoE",), runs_idle_experts=False, router_output=False, dense_weights=False,
                      fallback_flag="fd_fallback", shared_experts=("shared_experts",))


def register():
    pcp.register_block_kind(BLOCK)
