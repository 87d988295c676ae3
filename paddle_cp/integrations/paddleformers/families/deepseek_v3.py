"""DeepSeek-V3: listed experts, each run in training even on no token; `shared_experts` is its dense part."""
import paddle_cp as pcp

BLOCK = pcp.BlockKind(("DeepseekV3MoE",), runs_idle_experts=True, router_output=False, dense_weights=False,
                      fallback_flag="fd_fallback", shared_experts=("shared_experts",))


def register():
    pcp.register_block_kind(BLOCK)
