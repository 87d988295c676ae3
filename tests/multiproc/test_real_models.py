"""PaddleFormers models built with their defaults (eager attention) train at parity under ContextParallel.

One launch per world size: every family of tests/workers/paddleformers_models.py x {p2p, all2all} at N=2 (plus padding, packed documents
under sliding windows, the other attention implementations and recomputation), hybrid / padding /
all-gather rotation / recomputation at N=4; all lengths uneven.
"""
import pytest
from launcher import launch
from workers.paddleformers_models import FAMILIES

pytest.importorskip("paddleformers")

TOL = 1e-5
ATTENTION_FAMILIES = [f for f in FAMILIES if f != "qwen3_next"]  # its linear attention: test_hybrid_models.py
RUNS = {
    2: [f"{family}:{backend}" for family in ATTENTION_FAMILIES for backend in ("p2p", "all2all")]
    + ["llama:p2p:padded", "qwen3:all2all:padded", "gemma3:p2p:packed", "gpt_oss:all2all:packed",
       "gemma3:p2p:sdpa", "deepseek_v3:p2p:flashmask", "gpt_oss:all2all:flashmask"]
    # recomputation replays attention in backward: DeepSeek's selective "core_attn" (the attention function
    # alone, reentrant or not) and full-layer recompute of sliding-window models
    + ["deepseek_v3:p2p:core_attn", "deepseek_v3:all2all:core_attn_plain", "gemma3:p2p:full_recompute",
       "phi3:all2all:allgather:full_recompute"],
    4: ["llama:hybrid:2", "gemma3:hybrid:2:allgather", "gpt_oss:hybrid:2", "deepseek_v3:hybrid:2:allgather",
        "phi3:p2p:padded", "qwen3:all2all:allgather", "gpt_oss:hybrid:2:full_recompute",
        "deepseek_v3:hybrid:2:core_attn_plain", "qwen3_moe:hybrid:2", "ernie4_5:p2p:padded", "glm4_moe:all2all"],
}


@pytest.mark.parametrize("world", sorted(RUNS))
def test_paddleformers_models_train_at_parity(world):
    reports = launch("real_model_parity.py", world, *RUNS[world])
    for report in reports:
        assert not report["values"].get("crash"), report["values"]["crash"]
        assert report["values"]["runs"] == RUNS[world]
        for run in RUNS[world]:
            for kind in ("loss", "grad", "param"):
                assert report["max_abs"][f"{run}.{kind}"] <= TOL, (report["rank"], run, kind, report["max_abs"])
            losses = report["values"][f"{run}.losses"]
            assert losses[-1] < losses[0], f"{run}: training should reduce the loss"
            compared = report["values"][f"{run}.grads_compared"]
            assert any(name.endswith("self_attn.sinks") for name in compared) == run.startswith("gpt_oss"), run
        kind, message = report["errors"]["dynamic_rope"]
        assert kind == "ValueError" and "max(position_ids) + 1" in message
