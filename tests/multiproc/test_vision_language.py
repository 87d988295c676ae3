"""PaddleFormers' vision-language families under context parallelism with the plan users write: 3 AdamW steps equal
one card (losses, first-step logits, every gradient, parameters) on ring, Ulysses and hybrid, lengths 2N does not
divide, two images of different sizes, a video, packed samples, padded rows; PrepareContextParallel keyed as Paddle
spells it too; bad inputs and plans refused on every rank."""
import pytest

from launcher import launch

pytest.importorskip("paddleformers")

TOL = 1e-5
RUNS = {
    2: ["qwen2_5_vl:p2p:images", "qwen2_5_vl:all2all:video", "qwen2_5_vl:p2p:packed", "qwen2_5_vl:p2p:inner:rows",
        "qwen3_vl:p2p:video", "qwen3_vl:all2all:images", "qwen3_vl:p2p:language:packed",
        "qwen3_vl_moe:p2p:images", "qwen3_vl_moe:all2all:packed",
        "glm4v_moe:p2p:video", "glm4v_moe:all2all:images", "glm4v_moe:p2p:packed",
        "glm_ocr:p2p:images", "glm_ocr:all2all:packed", "glm_ocr:p2p:text",
        "paddleocr_vl:p2p:rows", "paddleocr_vl:all2all:packed"],
    4: ["qwen2_5_vl:hybrid:2:packed", "qwen2_5_vl:p2p:video", "qwen3_vl:hybrid:2:images",
        "qwen3_vl_moe:hybrid:2:video", "glm4v_moe:hybrid:2:video", "glm_ocr:hybrid:2:packed",
        "paddleocr_vl:hybrid:2:rows", "paddleocr_vl:p2p:images"],
}
REFUSALS = {  # bad input or plan -> what its error must say
    "too_few_image_tokens": "give each image as many placeholder tokens as its grid merges into",
    "grids_disagree_with_pixels": "pass the grids and pixel values the processor made together",
    "pixels_without_grids": "pass each image's grid",
    "rope_indices_transposed": "[3, batch, seq]",
    "vision_only_plan": "'model.language_model.layers.*.self_attn': pcp.ContextParallel('p2p')",
    "unknown_family": "pcp.register_vision_language",
}


@pytest.fixture(scope="module", params=sorted(RUNS))
def reports(request):
    return request.param, launch("vl_parity.py", request.param, *RUNS[request.param])


def test_vision_language_models_train_like_one_card(reports):
    world, reports = reports
    for report in reports:
        assert not report["values"].get("crash"), report["values"]["crash"]
        assert report["values"]["runs"] == RUNS[world]
        for run in RUNS[world]:
            for kind in ("loss", "logits", "grad", "param"):
                assert report["max_abs"][f"{run}.{kind}"] <= TOL, (report["rank"], run, kind, report["max_abs"])
            values = report["values"]
            assert values[f"{run}.grads_compared"] == values[f"{run}.params"], run  # every parameter's gradient
            local, whole = values[f"{run}.tokens"]  # split, and attended across
            assert local < whole and values[f"{run}.bytes_sent"] > 0, (run, local, whole)  # split, and attended across
            losses = values[f"{run}.losses"]
            assert losses[-1] < losses[0], f"{run}: training should reduce the loss"
    if world == 4:  # a rank holding nothing but video tokens (no label) trains too: its loss is a zero, not 0/0
        assert min(report["values"]["qwen2_5_vl:p2p:video.labelled"] for report in reports) == 0


def test_bad_inputs_and_plans_are_refused_on_every_rank(reports):
    _, reports = reports
    for report in reports:
        for name, fix in REFUSALS.items():
            kind, message = report["errors"][name]
            assert kind == "ValueError" and fix in message, (report["rank"], name, kind, message)
        for name in ("too_few_image_tokens", "grids_disagree_with_pixels", "pixels_without_grids",
                     "rope_indices_transposed"):  # refused in the batch check, before the model's collectives
            assert report["values"][f"{name}.sent"] == ["cp_batch_check"], (name, report["values"][f"{name}.sent"])
