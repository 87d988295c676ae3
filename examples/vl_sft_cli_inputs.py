"""What `pcp-train examples/vl_sft_cli.yaml` (a vision-language SFT YAML of PaddleFormers' CLI) reads, made offline:

- `<folder>/model`: a tiny Qwen3-VL (2 vision blocks on 4-pixel patches, 2x2 patches a token; 2 decoder layers)
  saved with `save_pretrained`; a byte-level tokenizer (the `tokenizers` package) whose first ids are Qwen's
  special tokens, at the ids the config names (`<|vision_start|>`, `<|image_pad|>`, ...); and the processor
  `AutoProcessor.from_pretrained` loads (Qwen2-VL's image processor and Qwen3-VL's video processor at the tower's
  patch sizes, preprocessor_config.json and video_preprocessor_config.json);
- `<folder>/pictures/*.png`: pictures drawn with PIL, a shape on a background, of four sizes;
- `<folder>/train.jsonl`: SFT samples in PaddleFormers' messages format, one per line, the pictures given by
  paths relative to the file: `{"messages": [{"role": "user", "content": "<image>What is in the picture?"},
  {"role": "assistant", "content": "A red circle on blue."}], "images": ["pictures/0.png"]}`; every fourth
  sample asks about two pictures.

    python examples/vl_sft_cli_inputs.py runs/vl_sft_cli
"""
from __future__ import annotations

import json
import os
import sys

from sft_cli_inputs import byte_tokenizer

# Qwen's special tokens, ids 0.. (<|endoftext|> pads, <|im_end|> ends a turn)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
TOKEN_IDS = dict(vision_start_token_id=SPECIAL.index("<|vision_start|>"), vision_end_token_id=SPECIAL.index(
    "<|vision_end|>"), image_token_id=SPECIAL.index("<|image_pad|>"), video_token_id=SPECIAL.index("<|video_pad|>"))
MAX_POSITIONS = 4096
# the fused RMSNorm kernel is GPU-only; rope halves (16 / 2) given to t, h, w, interleaved as Qwen3-VL's
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, fuse_rms_norm=False, max_position_embeddings=MAX_POSITIONS,
            rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True})
PATCH, TEMPORAL, MERGE = 4, 2, 2  # 4-pixel patches, 2 frames a temporal patch, 2x2 patches merged into one token
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH,
              temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, out_hidden_size=TEXT["hidden_size"],
              num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
MAX_PIXELS = 64 * 64  # larger pictures are scaled down to this many pixels (64 tokens)
COLORS = {"red": (220, 40, 40), "green": (40, 170, 70), "blue": (50, 70, 220), "yellow": (235, 210, 50),
          "white": (245, 245, 245), "black": (20, 20, 20)}
SHAPES = ("square", "circle", "triangle")
# (width, height): 4 x 4, 6 x 4, 4 x 6 and 8 x 5 tokens
SIZES = ((32, 32), (48, 32), (32, 48), (64, 40))


def write_tokenizer(folder):
    """The byte-level tokenizer with Qwen's special tokens, as a Qwen2 tokenizer. Returns the vocabulary size."""
    tokenizer = byte_tokenizer(SPECIAL)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "Qwen2TokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "model_max_length": MAX_POSITIONS}, f)
    return tokenizer.get_vocab_size()


def write_processor(folder):
    """The image and video processors at the tower's patch sizes (the tokenizer is in `folder` already)."""
    from paddleformers.transformers import AutoTokenizer
    from paddleformers.transformers.qwen2_vl.image_processor_fast import Qwen2VLImageProcessorFast
    from paddleformers.transformers.qwen3_vl.processor import Qwen3VLProcessor
    from paddleformers.transformers.qwen3_vl.video_processor import Qwen3VLVideoProcessor

    sizes = dict(patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE)
    Qwen3VLProcessor(image_processor=Qwen2VLImageProcessorFast(**sizes, min_pixels=16, max_pixels=MAX_PIXELS),
                     tokenizer=AutoTokenizer.from_pretrained(folder),
                     video_processor=Qwen3VLVideoProcessor(**sizes, size={"shortest_edge": 16,
                                                                          "longest_edge": MAX_PIXELS})
                     ).save_pretrained(folder)


def write_model(folder, vocab_size, seed=0):
    """The tiny Qwen3-VL through its one-card class (PaddleFormers' default class for qwen3_vl is fleet's)."""
    import paddle
    from paddleformers.transformers.qwen3_vl.configuration import Qwen3VLConfig
    from paddleformers.transformers.qwen3_vl.modeling import Qwen3VLForConditionalGenerationDeprecated

    paddle.seed(seed)
    config = Qwen3VLConfig(text_config={**TEXT, "vocab_size": vocab_size}, vision_config=VISION, **TOKEN_IDS)
    config.fuse_rms_norm = config.vision_config.fuse_rms_norm = False  # the vision config drops the keyword
    Qwen3VLForConditionalGenerationDeprecated(config).save_pretrained(folder, safe_serialization=True)


def draw(path, shape, color, background, size):
    """A `color` `shape` filling the middle half of a `background` picture of `size`, saved as PNG."""
    from PIL import Image, ImageDraw

    width, height = size
    image = Image.new("RGB", size, COLORS[background])
    box = [width // 4, height // 4, 3 * width // 4, 3 * height // 4]
    draw_on = ImageDraw.Draw(image)
    if shape == "square":
        draw_on.rectangle(box, fill=COLORS[color])
    elif shape == "circle":
        draw_on.ellipse(box, fill=COLORS[color])
    else:
        draw_on.polygon([(box[0], box[3]), ((box[0] + box[2]) // 2, box[1]), (box[2], box[3])], fill=COLORS[color])
    image.save(path)


def write_dataset(folder, samples):
    """`samples` messages-format lines, each picture drawn by its own description; every fourth sample two
    pictures. Returns the jsonl's path."""
    os.makedirs(os.path.join(folder, "pictures"), exist_ok=True)
    names, pictures = list(COLORS), 0

    def picture():
        nonlocal pictures
        i, pictures = pictures, pictures + 1
        shape, color = SHAPES[i % len(SHAPES)], names[i % len(names)]
        background = names[(i + 1 + i // len(names)) % len(names)]  # never the shape's color
        path = f"pictures/{i}.png"
        draw(os.path.join(folder, path), shape, color, background, SIZES[i % len(SIZES)])
        return path, f"a {color} {shape} on {background}"

    path = os.path.join(folder, "train.jsonl")
    with open(path, "w") as f:
        for sample in range(samples):
            shown = [picture() for _ in range(2 if sample % 4 == 3 else 1)]
            question = "<image>" * len(shown) + ("What is in the picture?" if len(shown) == 1 else
                                                 "What are in the pictures?")
            answer = ", then ".join(description for _, description in shown)
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer[0].upper() + answer[1:] + "."}],
                                "images": [image for image, _ in shown]}) + "\n")
    return path


def build(folder, samples=48):
    """model/ (weights, config, tokenizer, processor), pictures/ and train.jsonl under `folder`; returns the
    model's and the jsonl's paths."""
    model = os.path.join(folder, "model")
    os.makedirs(model, exist_ok=True)
    write_model(model, write_tokenizer(model))
    write_processor(model)
    return model, write_dataset(folder, samples)


if __name__ == "__main__":
    print(*build(sys.argv[1] if len(sys.argv) > 1 else "runs/vl_sft_cli"), sep="\n")
