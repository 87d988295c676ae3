"""PaddleOCR-VL: the top model merges (image features assigned at the image tokens) and calls its ERNIE 4.5
decoder `model` with rope indices [3, b, s]; one image per sample. Its SigLIP tower `visual` takes its patches as
[1, patches, c, p, p] with a position per patch and the images' boundaries, and returns patch features, which its
projector `mlp_AR` merges."""
import numpy as np
import paddle

import paddle_cp as pcp


def local_inputs(arguments, grids):
    """The images' boundaries and indices the top model derives from the whole grid, for this rank's images."""
    patches = grids.prod(axis=1)
    arguments["cu_seqlens"] = paddle.to_tensor(np.concatenate([[0], np.cumsum(patches)]), dtype="int32")
    arguments["sample_indices"] = paddle.to_tensor(np.repeat(np.arange(len(grids)), patches))


RULE = pcp.VisionLanguage(
    "paddleformers.transformers.paddleocr_vl", merges={"PaddleOCRVLForConditionalGeneration": "model"},
    language_models=("Ernie4_5Model",), media=(pcp.IMAGES,),
    vision=pcp.VisionTower(("PaddleOCRVisionModel",), pixels="pixel_values", grid="image_grid_thw", pixels_axis=1,
                           per_patch=("position_ids",), local_inputs=local_inputs, outputs="patches",
                           merger=("Projector",)))


def register():
    pcp.register_vision_language(RULE)
