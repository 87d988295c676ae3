"""gpt-oss: stacked experts called as `experts(hidden [b, s, H], router_indices=[T, k], routing_weights=[T, E])`
(dense weights); its (hidden, router logits) output reaches the model's aux loss."""
import paddle_cp as pcp

BLOCK = pcp.BlockKind(("GptOssMLP",), runs_idle_experts=False, router_output=True, dense_weights=True)


def register():
    pcp.register_block_kind(BLOCK)
