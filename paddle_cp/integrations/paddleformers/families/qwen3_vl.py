"""Qwen3-VL and Qwen3-VL-MoE (their non-fleet `...Deprecated` classes): rope indices [3, b, s]; deepstack features,
one row per image or video token (`visual_pos_masks`), added to those tokens' hidden states after early decoder
layers."""
import paddle_cp as pcp

DEEPSTACK = {"deepstack_visual_embeds": "visual_pos_masks"}
RULES = (
    pcp.VisionLanguage(
        "paddleformers.transformers.qwen3_vl",
        merges={"Qwen3VLForConditionalGenerationDeprecated": "model.language_model",
                "Qwen3VLModelDeprecated": "language_model"},
        language_models=("Qwen3VLTextModel",), rows=DEEPSTACK,
        vision=pcp.VisionTower(("Qwen3VLVisionModel",), outputs="with_deepstack")),
    pcp.VisionLanguage(
        "paddleformers.transformers.qwen3_vl_moe",
        merges={"Qwen3VLMoeForConditionalGenerationDeprecated": "model.language_model",
                "Qwen3VLMoeModelDeprecated": "language_model"},
        language_models=("Qwen3VLMoeTextModel",), rows=DEEPSTACK,
        vision=pcp.VisionTower(("Qwen3VLMoeVisionModel",), outputs="with_deepstack")),
)


def register():
    for rule in RULES:
        pcp.register_vision_language(rule)
