"""PaddleFormers' vision-language families under context parallelism with the plan users write: 3 AdamW steps equal
one card (losses, first-step logits, every gradient, parameters) on ring, Ulysses and hybrid, lengths 2N does not
divide, two images of different sizes, a video, packed samples, padded rows (ERNIE-4.5-VL: images, a video), the
vision tower split by images, Qwen2.5-VL in the bf16 O2 emulation;
PrepareContextParallel keyed as Paddle spells it too; bad inputs and plans refused on every rank."""
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
        "paddleocr_vl:p2p:rows", "paddleocr_vl:all2all:packed",
        "ernie4_5_vl:p2p:images", "ernie4_5_vl:all2all:video",
        # the vision tower split by images too
        "qwen2_5_vl:p2p:split:images", "qwen3_vl:all2all:split:video", "glm_ocr:p2p:split:images",
        "paddleocr_vl:p2p:split:rows", "paddleocr_vl:p2p:split:frozen:packed"],
    4: ["qwen2_5_vl:hybrid:2:packed", "qwen2_5_vl:p2p:video", "qwen3_vl:hybrid:2:images",
        "qwen3_vl_moe:hybrid:2:video", "glm4v_moe:hybrid:2:video", "glm_ocr:hybrid:2:packed",
        "paddleocr_vl:hybrid:2:rows", "paddleocr_vl:p2p:images",
        "ernie4_5_vl:hybrid:2:images", "ernie4_5_vl:p2p:video",
        "qwen2_5_vl:p2p:split:video", "qwen3_vl_moe:hybrid:2:split:images", "glm4v_moe:p2p:split:video",
        "glm_ocr:all2all:split:packed", "paddleocr_vl:hybrid:2:split:packed", "qwen3_vl:p2p:split:frozen:images",
        "paddleocr_vl:p2p:split:l3:packed"],  # sharding level 3: the tower fetched on a rank running no piece too
}
REFUSALS = {  # bad input or plan -> what its error must say
    "too_few_image_tokens": "give each image as many placeholder tokens as its grid merges into",
    "grids_disagree_with_pixels": "pass the grids and pixel values the processor made together",
    "pixels_without_grids": "pass each image's grid",
    "rope_indices_transposed": "[3, batch, seq]",
    "vision_only_plan": "'model.language_model.layers.*.self_attn': pcp.ContextParallel('p2p')",
    "unknown_family": "pcp.register_vision_language",
    "tower_without_merge": "key pcp.PrepareContextParallel() on the model the tower belongs to",
    "ernie_documents_dropped": "Pass the documents as a dense attention_mask [batch, 1, seq, seq]",
    "ernie_too_few_video_tokens": "grids make 8 features (ceil(t / 2) x h x w / 4, summed)",
    "ernie_keyed_on_decoder": "key PrepareContextParallel on the top model ('') instead",
    "ernie_second_head": "has mm_vocab_size=8: its second head scores only the tokens whose label is an image",
    "ernie_vision_split": "paddle_cp splits a vision tower by images only where its family's rule names the tower",
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
            sharded = ":l3:" in run  # its gradients are shards: its parameters after the steps say the same
            for kind in ("loss", "logits", "param") + (() if sharded else ("grad",)):
                assert report["max_abs"][f"{run}.{kind}"] <= TOL, (report["rank"], run, kind, report["max_abs"])
            values = report["values"]
            if not sharded:
                assert values[f"{run}.grads_compared"] == values[f"{run}.params"], run  # every parameter's gradient
            local, whole = values[f"{run}.tokens"]  # split, and attended across
            assert local < whole and values[f"{run}.bytes_sent"] > 0, (run, local, whole)  # split, and attended across
            losses = values[f"{run}.losses"]
            assert losses[-1] < losses[0], f"{run}: training should reduce the loss"
    split = [run for run in RUNS[world] if ":split:" in run]
    for run in split:  # every piece ran once, on one rank; each feature sent only where its token is
        pieces = [report["values"][f"{run}.pieces"] for report in reports]
        assert sum(mine for mine, _ in pieces) == pieces[0][1], (run, pieces)
        assert all(mine < total for mine, total in pieces), (run, pieces)  # no rank ran every piece
        for report in reports:
            values = report["values"]
            assert values[f"{run}.vision_sent"] == values[f"{run}.vision_expected"], (run, report["rank"])
    if world == 4:  # ranks running no piece take part (their exchange's backward too)
        assert any(report["values"][f"{run}.pieces"][0] == 0 for run in split for report in reports)
    if world == 4:  # a rank holding nothing but video tokens (no label) trains too: its loss is a zero, not 0/0
        for run in ("qwen2_5_vl:p2p:video", "ernie4_5_vl:p2p:video"):
            assert min(report["values"][f"{run}.labelled"] for report in reports) == 0, run


def test_ernie_vl_ranks_route_their_tokens_as_one_card(reports):
    """ERNIE-VL's decoder layers send text tokens to the text experts of the multimodal MoE block when any token of
    what they get is an image's, else to `mlp_text` (the same experts, on their own): the shifted token types' last
    column makes every rank decide as one card over the whole batch, a rank of text tokens only included (ring 4 of
    the video batch), so every rank has every gradient the batch gives (no bucket agreed uneven)."""
    world, reports = reports
    for report in reports:
        for run in (run for run in RUNS[world] if run.startswith("ernie4_5_vl")):
            assert report["values"][f"{run}.uneven_buckets"] == 0, (report["rank"], run)
    if world == 4:
        assert any(report["values"]["ernie4_5_vl:p2p:video.text_only"] for report in reports)


def test_bad_inputs_and_plans_are_refused_on_every_rank(reports):
    _, reports = reports
    for report in reports:
        for name, fix in REFUSALS.items():
            kind, message = report["errors"][name]
            assert kind == "ValueError" and fix in message, (report["rank"], name, kind, message)
        for name in ("too_few_image_tokens", "grids_disagree_with_pixels", "pixels_without_grids",
                     "rope_indices_transposed", "ernie_documents_dropped", "ernie_too_few_video_tokens"):
            # refused in the batch check, before the model's collectives
            assert report["values"][f"{name}.sent"] == ["cp_batch_check"], (name, report["values"][f"{name}.sent"])


def test_bf16_o2_with_the_tower_split_is_as_close_to_fp32_as_one_card(reports):
    """Qwen2.5-VL, a video, its tower split by images, in the CPU emulation of bf16 O2 with fp32 master gradients
    (tests/workers/emulated_amp.py): its losses and final master weights as far from an fp32 one-card run as one
    card in the same emulation, within 2x (a loss within half a bf16 ulp of it counts as one card's)."""
    _, reports = reports
    for report in reports:
        values = report["values"]
        own, got = dict(values["bf16.one_card"]), values["bf16.paddle_cp"]
        own["loss"] = max(own["loss"], values["bf16.loss_half_ulp"])
        assert got["loss"] <= 2 * own["loss"] and got["weights"] <= 2 * own["weights"], (got, own)
        assert own["weights"] > 1e-2  # bf16 really ran: one card is far from fp32
