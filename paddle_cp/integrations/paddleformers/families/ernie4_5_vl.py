"""ERNIE-4.5-VL (`ernie4_5_moe_vl`): the top model merges (the resampler's features assigned at `im_patch_id`) and
calls its decoder `model` with rope indices [b, s, 3] and `token_type_ids` [b, s + 1] (each token's type, then
its last label's); images and video frames share one placeholder and one grid list, two frames merging into a
token. The decoder routes by its tokens' types; its head and loss get the labels' types, `token_type_ids[..., 1:]`.
The top drops `attn_mask_startend_row_indices` (packed documents attend across each other on one card). Its loss
rules other than the text tokens' mean are refused."""
import paddle_cp as pcp

MEDIA = pcp.Media("image or video", "images", "grid_thw", "im_patch_id", frames="temporal_conv_size")
RULE = pcp.VisionLanguage(
    "paddleformers.transformers.ernie4_5_moe_vl", merges={"Ernie4_5_VLMoeForConditionalGeneration": "model"},
    language_models=("Ernie4_5_Model",), positions="bs3", media=(MEDIA,), merge="spatial_conv_size",
    shifted=("token_type_ids",),
    after_language_model={"lm_head": ("token_type_ids_labels",), "criterion": ("token_type_ids_shifted",)},
    documents=False,
    refused={"mm_vocab_size": (0, "its second head scores only the tokens whose label is an image special token, "
                               "their loss a mean of its own added to the text tokens' (a rank holding no text label "
                               "asserts; one count of labelled tokens cannot weigh two means)"),
             "num_nextn_predict_layers": (0, "its multi-token prediction layers take each row's last tokens, a "
                                             "rank's last local tokens under context parallelism"),
             "token_balance_loss": (False, "its gradient is each rank's summed token loss over token_balance_seqlen, "
                                           "not the token mean the labelled-token weights make one card's")})


# its text loss (one head: mm_vocab_size 0), the token mean over labels that are not `ignored_index`: on a share
# with none it warns and gives 0 itself; guarded, the placeholder labels' zero without the warning
LOSS = pcp.LossLayer("paddleformers.transformers.ernie4_5_moe_vl", ("ErniePretrainingCriterion",))


def register():
    pcp.register_vision_language(RULE)
    pcp.register_loss_layer(LOSS)
