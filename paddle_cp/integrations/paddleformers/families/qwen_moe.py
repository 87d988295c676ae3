"""Qwen2-MoE and Qwen3-MoE: listed experts, each run in training even on no token (a zero gradient); Qwen2's
dense part is its `shared_expert`. They return their router logits, but PaddleFormers 1.2.0's decoder layer drops
them: no aux loss reaches the model."""
import paddle_cp as pcp

BLOCK = pcp.BlockKind(("Qwen3MoeSparseMoeBlock", "Qwen2MoeSparseMoeBlock"), runs_idle_experts=True,
                      router_output=False, dense_weights=False, fallback_flag="fd_fallback",
                      shared_experts=("shared_expert",))


def register():
    pcp.register_block_kind(BLOCK)
