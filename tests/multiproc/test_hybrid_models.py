"""Qwen3-Next (Gated DeltaNet + full attention) under ContextParallel on `self_attn` and `linear_attn` vs one card.

One launch per world size. Qwen3-Next's tiny default config amplifies fp32 rounding: one card differs from
itself by ~1e-5 (logits) to ~5e-4 (losses after 3 steps) when its own rule is merely chunked otherwise, so
each figure must be within max(1e-5, FLOOR_FACTOR x that floor), measured in the same worker on the same
batch. A single GDN layer, a Conv1D model and the refusals are checked too.
"""
import pytest
from launcher import launch

pytest.importorskip("paddleformers")

TOL = 1e-5
FLOOR_FACTOR = 4
RUNS = {
    # runs > 64 tokens (the rule's chunks crossed inside a run): the 280-token layer (p2p runs of 70) and the
    # 70-token all2all model; the checks (refusals, Conv1D model) once
    2: ["layer:p2p:280", "p2p", "all2all:sdpa:fused_conv:seq=70", "p2p:packed", "all2all:padded:decoder", "checks"],
    # layer:p2p:4: 4 tokens over 6 chunks, runs of one token, shorter than the conv's 3; a layer replayed by
    # recompute; packed: the documents layout splits those batches (ring groups balanced by attention work)
    3: ["layer:p2p:4", "layer:all2all:20:recompute", "p2p", "all2all", "p2p:packed"],
    4: ["layer:hybrid:2:70", "p2p:seq=9", "hybrid:2:sdpa", "hybrid:2:packed"],
}
REFUSED = {
    "self_attn_only": ["model.layers.0.linear_attn (Gated DeltaNet", "'model.layers.*.linear_attn': "
                       "pcp.ContextParallel('p2p')"],
    "attention_outside": ["model.layers.3.self_attn (softmax attention)", "'model.layers.*.self_attn'"],
    "lstm": ["mix (recurrent layer", "no context-parallel form"],
    "lstm_routed": ["LSTM", "no context-parallel form"],
    "conv1d": ["mix (Conv1D over the sequence), same (Conv1D over the sequence)", "'mix': pcp.ContextParallel"],
    "nested": ["keyed on '' and on 'mix'"],
    "unrouted_sdpa": ["scaled_dot_product_attention ran outside every ContextParallel layer"],
    "conv1d_script_split": ["mix (Conv1D over the sequence)", "'mix': pcp.ContextParallel('p2p')"],
}


def _within(report, name, kinds):
    for kind in kinds:
        floor = report["values"][f"{name}.floor"][kind]
        assert report["max_abs"][f"{name}.{kind}"] <= max(TOL, FLOOR_FACTOR * floor), (
            report["rank"], name, kind, report["max_abs"][f"{name}.{kind}"], floor)


@pytest.mark.parametrize("world", sorted(RUNS))
def test_qwen3_next_trains_at_parity(world):
    reports = launch("hybrid_model_parity.py", world, *RUNS[world])
    for report in reports:
        values = report["values"]
        assert not values.get("crash"), values["crash"]
        for run in values["runs"]:
            _within(report, run, ("logits", "loss", "grad", "param"))
            assert values[f"{run}.losses"][-1] < values[f"{run}.losses"][0], run
            assert values[f"{run}.grads_compared"] > 40, run
        for layer in values["layers"]:
            _within(report, f"gdn_layer.{layer}", ("out", "grad"))
        assert len(values["runs"]) + len(values["layers"]) == len([r for r in RUNS[world] if r != "checks"])
        if "checks" in RUNS[world]:
            assert report["max_abs"]["conv_model.out"] <= TOL and report["max_abs"]["conv_model.grad"] <= TOL
            for case, fragments in REFUSED.items():
                kind, message = report["errors"][case]
                assert kind == "ValueError" and all(f in message for f in fragments), (case, kind, message)
            assert report["errors"]["token_wise"] == ["no error", ""]
            assert values["token_wise.local_len"] == (3, 2)[report["rank"]]  # 5 tokens over 2 ranks, split
