"""Qwen2.5-VL: its language model `model.language_model` takes the merged embeddings and rope indices
[3, b, s] (or [4, b, s], text positions first, for packed samples); its vision tower `model.visual` attends within
windows but in its `fullatt_block_indexes` blocks."""
import paddle_cp as pcp

RULE = pcp.VisionLanguage(
    "paddleformers.transformers.qwen2_5_vl",
    merges={"Qwen2_5_VLForConditionalGeneration": "model.language_model", "Qwen2_5_VLModel": "language_model"},
    language_models=("Qwen2_5_VLTextModel",),
    vision=pcp.VisionTower(("Qwen2_5_VisionTransformerPretrainedModel",), windowed=True))


def register():
    pcp.register_vision_language(RULE)
