"""PaddleOCR-VL: the top model merges (image features assigned at the image tokens) and calls its ERNIE 4.5
decoder `model` with rope indices [3, b, s]; one image per sample."""
import paddle_cp as pcp

RULE = pcp.VisionLanguage(
    "paddleformers.transformers.paddleocr_vl", merges={"PaddleOCRVLForConditionalGeneration": "model"},
    language_models=("Ernie4_5Model",), media=(pcp.IMAGES,))


def register():
    pcp.register_vision_language(RULE)
