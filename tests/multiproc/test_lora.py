"""PaddleFormers' LoRAModel on a PaddleFormers Llama under mp (Paddle's LoRA plan keys; its sequence-parallel
plan, which names no factor), sep, dp (sharding levels with frozen parameters in the optimizer), pp and
combined meshes: 3 AdamW steps against one card with the
same LoRA model; checkpoints across meshes and export_pretrained of the trained adapter.

One 4-rank launch (tests/workers/lora_parity.py); the reference is computed in the worker.
"""
import pytest
from launcher import launch

pytest.importorskip("paddleformers")

TOL = 1e-5
RUNS = ("mp4:gather", "sep4", "dp4:l3", "dp2xmp2:l2:sp", "mp2xsep2", "pp2xmp2")
FIRST_LAYER_SHAPES = {  # this rank's lora_A / lora_B of layer 0's q_proj and o_proj, by run
    "mp4:gather": ([64, 8], [8, 16], [16, 8], [8, 64]),
    "sep4": ([64, 8], [8, 64], [64, 8], [8, 64]),
    "dp2xmp2:l2:sp": ([64, 8], [8, 32], [32, 8], [8, 64]),  # factors split as the layers' forward needs
    "mp2xsep2": ([64, 8], [8, 32], [32, 8], [8, 64]),
}


@pytest.fixture(scope="module")
def merged_directory(tmp_path_factory):
    return tmp_path_factory.mktemp("lora") / "merged"


@pytest.fixture(scope="module")
def reports(merged_directory):
    reports = launch("lora_parity.py", 4, merged_directory, *RUNS)
    for report in reports:
        assert not report["values"].get("crash"), report["values"]["crash"]
    return reports


@pytest.mark.parametrize("run", RUNS)
def test_lora_trains_like_one_card(reports, run):
    for report in reports:
        values, diffs = report["values"], report["max_abs"]
        for kind in ("loss", "grad", "param"):
            assert diffs[f"{run}.{kind}"] <= TOL, (report["rank"], run, kind, diffs[f"{run}.{kind}"])
        assert diffs[f"{run}.frozen"] == 0.0 and diffs[f"{run}.frozen_moved"] == 0.0, run
        assert values[f"{run}.grads_compared"] > 0
        trainable = values[f"{run}.trainable"]
        assert len(trainable) == 2 * 7 * 2 and all(n.rsplit(".", 1)[1] in ("lora_A", "lora_B") for n in trainable)
        assert all(n.startswith("model.model.layers.") for n in trainable)  # LoRAModel's `model.` prefix
        losses = values[f"{run}.losses"]
        assert losses[-1] < losses[0], f"{run}: training should reduce the loss"


def test_each_lora_factor_is_split_where_paddle_places_it(reports):
    layer = "model.model.layers.0.self_attn."
    for report in reports:
        for run, (q_a, q_b, o_a, o_b) in FIRST_LAYER_SHAPES.items():
            shapes = report["values"][f"{run}.local_shapes"]
            got = (shapes[layer + "q_proj.lora_A"], shapes[layer + "q_proj.lora_B"],
                   shapes[layer + "o_proj.lora_A"], shapes[layer + "o_proj.lora_B"])
            assert got == (q_a, q_b, o_a, o_b), (run, got)


def test_checkpoint_moves_between_meshes_and_into_one_process(reports):
    for report in reports:
        for target in ("sep4", "one_process"):
            assert report["max_abs"][f"checkpoint.{RUNS[0]}->{target}"] <= TOL, target


def test_export_holds_the_trained_adapter_as_lora_model_names_it(reports):
    for report in reports:
        values = report["values"]
        assert values["export.files"] == ["config.json", "lora_config.json", "lora_model_state.pdparams"]
        assert values["export.keys_match"]
        assert len(values["export.saved_keys"]) == 28
        assert all(k.startswith("model.layers.") and k.rsplit(".", 1)[1] in ("lora_A", "lora_B")
                   for k in values["export.saved_keys"])
        assert report["max_abs"]["export.lora"] <= TOL


def test_merged_export_is_the_model_one_card_would_merge(reports, merged_directory):
    """export_pretrained(merge_lora=True) loads into a plain LlamaForCausalLM as one card's W + A @ B * scaling."""
    import numpy as np
    from paddleformers.transformers import LlamaForCausalLM

    want = dict(np.load(merged_directory / "expected.npz"))
    loaded = {name: value.numpy() for name, value in LlamaForCausalLM.from_pretrained(str(merged_directory))
              .state_dict().items()}
    assert sorted(loaded) == sorted(want)
    assert max(float(np.abs(loaded[name] - value).max()) for name, value in want.items()) <= TOL
