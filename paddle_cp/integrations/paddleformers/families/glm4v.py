"""GLM-4.5V (`glm4v_moe`) and GLM-OCR: rope indices [3, b, s]; a video's frames are image tokens between its
video start and end tokens, so images and videos share the image placeholder."""
import paddle_cp as pcp

VIDEO_FRAMES = pcp.Media("video", "pixel_values_videos", "video_grid_thw", "image_token_id")
RULES = (
    pcp.VisionLanguage(
        "paddleformers.transformers.glm4v_moe",
        merges={"Glm4vMoeForConditionalGeneration": "model.language_model", "Glm4vMoeModel": "language_model"},
        language_models=("Glm4vMoeTextModel",), media=(pcp.IMAGES, VIDEO_FRAMES),
        vision=pcp.VisionTower(("Glm4vMoeVisionModel",))),
    pcp.VisionLanguage(
        "paddleformers.transformers.glm_ocr",
        merges={"GlmOcrForConditionalGeneration": "model.language_model", "GlmOcrModel": "language_model"},
        language_models=("GlmOcrTextModel",), media=(pcp.IMAGES, VIDEO_FRAMES),
        vision=pcp.VisionTower(("GlmOcrVisionModel",), outputs="pooler")),
)


def register():
    for rule in RULES:
        pcp.register_vision_language(rule)
