"""A tiny PaddleFormers 1.2.0 ERNIE-4.5-VL MoE (`Ernie4_5_VLMoeForConditionalGeneration`) that builds and trains
on one CPU process, and its training batches (image, text-only, video) as PaddleFormers' mm_collate_fn makes them:
the family's test helper (tests/workers/vl_models.py builds it for the vision-language parity launches).

CPU stand-ins (test helpers: PaddleFormers module attributes only, nothing in paddle_cp): stub_ernie_vl_stand_ins.
What differs from GPU maths: the vision attention kernel only. The stand-in computes softmax(QK^T/sqrt(d))V in fp32
from the same bf16-rounded q/k/v with the same per-image/per-frame block mask and rounds the output to bf16 as the
kernel does (the GPU kernel also rounds P to bf16 before PV and sums in tile order: last-bit differences), then hands
it on as fp32, since the fp32 tower's `proj` cannot take bf16 (on CPU F.linear(bf16, fp32 weight) raises
InvalidArgument; so GPU training runs this tower under bf16 AMP). The parity build (PARITY) keeps q/k/v in fp32
instead (`_vision_attention_in_fp32`). Everything else is the model's own code in fp32.
"""
from __future__ import annotations

import numpy as np
from pictures import clip, picture

PATCH, MERGE, TEMPORAL = 4, 2, 2  # vision patch side, spatial merge (2x2 patches -> 1 token), frames per temporal conv
PAD, BOS, EOS = 0, 1, 2
IM_PATCH, IMAGE_START, IMAGE_END, VIDEO_START, VIDEO_END = 100, 101, 102, 103, 104  # inside the 128-token vocab
TEXT = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, fuse_rms_norm=False, freq_allocation=2,  # head_dim 16: 2 of 8 freqs to t, 3+3 h/w
            moe_num_experts=[4, 4], moe_k=2, moe_intermediate_size=[32, 16], moe_num_shared_experts=1,
            moe_layer_start_index=1, moe_layer_interval=1,  # layer 0 dense, layer 1 MoE (as the release configs)
            moe_capacity=[8, 8, 8])  # capacity = 8 * tokens // 8 experts = every token: no token is ever dropped
# the parity build (tests/workers/vl_models.py): router losses off (each rank's are statistics of its own tokens),
# the vision attention in fp32 (_vision_attention_in_fp32)
PARITY = dict(router_aux_loss_coef=0.0, router_z_loss_coef=0.0, moe_orthogonal_loss_lambda=0.0, vision_bf16=False)
VISION = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=PATCH,
              spatial_merge_size=MERGE, in_channels=3)


class _Done:
    """A finished host-copy task (what core.AsyncLoad's task is after its wait)."""

    def cpu_wait(self):
        pass

    cuda_wait = wait = cpu_wait


def _slots(expert_id, num_experts):
    """Each (token, choice) pair's row inside its expert, pairs taken choice-major (k * s + t) as the GPU kernels
    sort them: returns the expert of each pair, its row in that expert, the untruncated count per expert."""
    import paddle.nn.functional as F

    flat = expert_id.transpose([1, 0]).reshape([-1]).astype("int64")  # [k*s], choice-major
    onehot = F.one_hot(flat, num_experts).astype("int64")
    row = ((onehot.cumsum(0) - 1) * onehot).sum(-1)
    return flat, row, onehot.sum(0)


def _moe_gate_dispatch(x, gate_prob, corr_bias, k, capacity, use_pad, name=None):
    """Stands in for paddle.incubate moe_gate_dispatch (GPU only): top-k of the gate probabilities, the chosen
    probabilities as combine weights, tokens copied to [experts * capacity] rows (zero rows padding); a gather and
    take_along_axis, so the gradients reach x and gate_prob exactly as its grad kernel sends them."""
    import paddle

    assert corr_bias is None and use_pad, "stand-in covers the configs built here (no aux-free bias, padded)"
    s, e = gate_prob.shape
    expert_id = paddle.topk(gate_prob.detach(), k, axis=-1)[1]  # [s, k]
    weights = paddle.take_along_axis(gate_prob, expert_id, axis=1)
    flat, row, counts = _slots(expert_id, e)
    keep = row < capacity
    dest = paddle.where(keep, flat * capacity + row, paddle.zeros_like(row))
    spare = paddle.full_like(dest, e * capacity)  # dropped pairs write one spare row, cut off (none drop here)
    source = paddle.full([e * capacity + 1], s, "int64").scatter(paddle.where(keep, dest, spare),
                                                                 paddle.arange(k * s, dtype="int64") % s)[:-1]
    y = paddle.concat([x, paddle.zeros([1, x.shape[1]], x.dtype)]).gather(source)
    weights = weights * keep.reshape([k, s]).transpose([1, 0]).astype(weights.dtype)
    return y, weights, dest.reshape([k, s]).astype("int32"), counts.cumsum(), expert_id.astype("int32")


def _combining(x, combine_weights, scatter_index, hard_gate=False):
    """Stands in for moe_layer.combining (moe_combine and its grad, GPU only): y[t] = sum_k w[t,k] x[idx[t,k]]."""

    s, k = scatter_index.shape
    picked = x.gather(scatter_index.reshape([-1]).astype("int64")).reshape([s, k, x.shape[-1]])
    if hard_gate:
        return picked.squeeze(-2)
    return (combine_weights.astype(x.dtype).unsqueeze(-1) * picked).sum(1)


def _expand_modality_expert_id(expert_id, num_expert_per_modality, group_size, modality_offset, is_group_expert,
                               name=None):
    """Stands in for expand_modality_expert_id (GPU only): the kernel's integer formula, with paddle ops."""
    import paddle

    e = expert_id
    if is_group_expert:
        e = e + (paddle.arange(e.shape[1], dtype=e.dtype) * group_size).unsqueeze(0)
    if num_expert_per_modality <= 0:
        return e
    n = num_expert_per_modality
    return (e // n) * (2 * n) + e % n + modality_offset * n


def _moe_gate_dispatch_partial_nosoftmaxtopk(x, combine_weights, expert_id, k, capacity, num_experts, use_pad,
                                             expert_start_index, expert_end_index, reverse_token_drop=False,
                                             name=None):
    """Stands in for moe_gate_dispatch_partial_nosoftmaxtopk (GPU only) on one card (all experts local): tokens
    copied to their experts' rows (unpadded, expert-major), the given weights and scatter indices into those rows,
    each row's source token, untruncated/truncated counts per expert; rows within an expert may sit in another order
    than the kernel's seqsort, which changes no result (experts act row-wise, the combine gathers by index)."""
    import paddle

    assert not use_pad and expert_start_index == 0 and expert_end_index == num_experts
    s = x.shape[0]
    flat, row, counts = _slots(expert_id, num_experts)
    assert int(counts.max()) <= capacity, "capacity drops tokens: not covered by this stand-in"
    dest = (paddle.concat([paddle.zeros([1], "int64"), counts.cumsum()[:-1]]).gather(flat) + row)
    source = paddle.zeros([k * s], "int64").scatter(dest, paddle.arange(k * s, dtype="int64") % s)
    y = x.gather(source)
    return y, combine_weights, dest.reshape([k, s]).astype("int32"), source.astype("int32"), counts, counts


def _build_src_rank_and_local_expert_id(expert_num_global_tensor, expert_num_global, num_local_experts, name=None):
    """Stands in for build_src_rank_and_local_expert_id (GPU only): each dispatched row's rank and local expert."""
    import paddle

    expert = np.repeat(np.arange(len(expert_num_global)), expert_num_global)
    return (paddle.to_tensor(expert // num_local_experts, "int32"),
            paddle.to_tensor(expert % num_local_experts, "int32"))


def _attention(q, k, v, startend_row_indices, causal):
    """softmax(QK^T / sqrt(d)) V in fp32 over [b, s, h, d] q/k/v, keys of column j visible to rows [UTE_j, LTS_j)
    (causal: rows >= j and < LTS_j): what flashmask_attention computes."""
    import paddle
    import paddle.nn.functional as F

    q, k, v = (t.astype("float32").transpose([0, 2, 1, 3]) for t in (q, k, v))  # [b, h, s, d]
    k = k.repeat_interleave(q.shape[1] // k.shape[1], axis=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], axis=1)
    rows = paddle.arange(q.shape[2], dtype="int32").reshape([1, 1, -1, 1])
    bounds = startend_row_indices.astype("int32").unsqueeze(2)  # [b, 1, 1, keys, c]: per key column j
    visible = rows < bounds[..., 0]
    if causal:
        assert startend_row_indices.shape[-1] == 1
        visible = visible & (rows >= paddle.arange(q.shape[2], dtype="int32").reshape([1, 1, 1, -1]))
    else:
        assert startend_row_indices.shape[-1] == 2
        visible = visible & (rows >= bounds[..., 1])
    scores = paddle.matmul(q, k, transpose_y=True) / float(np.sqrt(q.shape[-1]))
    scores = paddle.where(visible, scores, paddle.full_like(scores, float("-inf")))
    return paddle.matmul(F.softmax(scores, axis=-1), v).transpose([0, 2, 1, 3])


def _flashmask_attention(query, key, value, startend_row_indices=None, causal=False, dropout=0.0, **kwargs):
    """Stands in for flashmask_attention (GPU kernel; Paddle CPU has no bf16 matmul/softmax): `_attention` over the
    bf16 q/k/v, output rounded to bf16 as the kernel's, returned as fp32 for the fp32 tower."""
    assert dropout == 0.0
    return _attention(query, key, value, startend_row_indices, causal).astype("bfloat16").astype("float32")


def _vision_attention_in_fp32(self, hidden_states, startend_row_indices, rotary_pos_emb=None, attn_sep=False):
    """VisionFlashAttention2.forward (one card: no `attn_sep`) without its casts of q/k/v to bf16: the parity
    build's. With them, each rank's share of the tower's gradient is rounded to bf16 on its way back through the
    casts, one card's whole gradient once; a sum of roundings is not the rounding of the sum (2e-4 on this tower's
    gradients over 2 ranks): bf16 arithmetic, as in data parallel, not the split."""
    from paddleformers.transformers.ernie4_5_moe_vl.model.dfnrope.modeling import apply_rotary_pos_emb_vision

    assert not attn_sep
    seq_length = hidden_states.shape[0]
    qkv = self.qkv(hidden_states).reshape([seq_length, 3, self.num_heads, -1]).transpose(perm=[1, 0, 2, 3])
    q, k, v = qkv.unbind(axis=0)
    q, k = (apply_rotary_pos_emb_vision(t.unsqueeze(0), rotary_pos_emb) for t in (q, k))
    return self.proj(_attention(q, k, v.unsqueeze(0), startend_row_indices, False).reshape([seq_length, -1]))


_MODEL_FORWARDS = {}  # the PaddleFormers methods a stand-in replaces, kept to put back


def stub_ernie_vl_stand_ins(vision_bf16=True):
    """Installs the CPU stand-ins into the ERNIE-VL modules' namespaces (idempotent); `vision_bf16`: the vision
    attention's q/k/v cast to bf16 as the model does, else kept in fp32 (`_vision_attention_in_fp32`)."""
    import importlib

    from paddleformers.transformers.ernie4_5_moe_vl.model import modeling_moe
    from paddleformers.transformers.ernie4_5_moe_vl.model.dfnrope import modeling as dfnrope
    from paddleformers.transformers.ernie4_5_moe_vl.model.moe import moe_all_gather_layer, moe_layer, topk_gate

    aux = importlib.import_module("paddle.incubate.nn.functional.cal_aux_loss")  # (the package's name is the op)
    bincount = importlib.import_module("paddle.incubate.nn.functional.int_bincount")
    for module in (modeling_moe, moe_all_gather_layer):  # core.AsyncLoad: device->host copy; a clone, no maths
        module.get_async_loader = lambda: None
        module.async_offload = lambda tensor, loader: (tensor.clone(), _Done())
    # moe_gate_dispatch: the same top-k of the same probs, chosen probs as weights, rows gathered (none dropped)
    moe_layer.moe_gate_dispatch = _moe_gate_dispatch
    moe_layer.combining = _combining  # moe_combine(+grad): the same sum_k w[t,k] * expert_row[idx[t,k]], autograd
    moe_all_gather_layer.expand_modality_expert_id = _expand_modality_expert_id  # the kernel's integer formula
    # moe_gate_dispatch_partial_nosoftmaxtopk: the same rows per expert, weights and indices (row order aside)
    moe_all_gather_layer.moe_gate_dispatch_partial_nosoftmaxtopk = _moe_gate_dispatch_partial_nosoftmaxtopk
    # build_src_rank_and_local_expert_id: rank = expert // local experts, local id = expert % local experts
    moe_all_gather_layer.build_src_rank_and_local_expert_id = _build_src_rank_and_local_expert_id
    topk_gate.cal_aux_loss = aux.math_cal_aux_loss  # cal_aux_loss: Paddle's own maths reference of the kernel
    topk_gate.int_bincount = bincount.math_int_bincount  # int_bincount (aux-free only): Paddle's maths reference
    dfnrope.flashmask_attention = _flashmask_attention  # flashmask: same masked softmax(QK^T/sqrt d)V, fp32 inside
    vision_attention = dfnrope.VisionFlashAttention2
    model_forward = _MODEL_FORWARDS.setdefault("vision_attention", vision_attention.forward)
    vision_attention.forward = model_forward if vision_bf16 else _vision_attention_in_fp32


def build(vision_bf16=True, **text_overrides):
    """The tiny model: TEXT (overridable) and VISION, its config's defaults otherwise; in train mode; its vision
    attention as stub_ernie_vl_stand_ins(vision_bf16) makes it."""
    stub_ernie_vl_stand_ins(vision_bf16)
    from paddleformers.transformers.ernie4_5_moe_vl.model.configuration import Ernie4_5_VLMoeConfig
    from paddleformers.transformers.ernie4_5_moe_vl.modeling import Ernie4_5_VLMoeForConditionalGeneration

    config = Ernie4_5_VLMoeConfig(
        **{**TEXT, **text_overrides}, vision_config=VISION, pixel_hidden_size=VISION["hidden_size"],
        spatial_conv_size=MERGE, temporal_conv_size=TEMPORAL, im_patch_id=IM_PATCH, max_text_id=IM_PATCH,
        image_start_token_id=IMAGE_START, image_end_token_id=IMAGE_END, video_start_token_id=VIDEO_START,
        video_end_token_id=VIDEO_END, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    model = Ernie4_5_VLMoeForConditionalGeneration(config)
    model.train()
    return model


def image_processor():
    """The family's own image processor at the tiny tower's sizes (bf16 patches, [t, h, w] grids)."""
    from paddleformers.transformers.ernie4_5_moe_vl.image_processor import Ernie4_5_VLImageProcessor

    return Ernie4_5_VLImageProcessor(patch_size=PATCH, merge_size=MERGE, temporal_conv_size=TEMPORAL,
                                     min_pixels=16, max_pixels=64 * 64)


def sample(model, kind="image", images=((28, 20), (16, 24)), video=(4, 20, 12), text=(5, 6), seed=0):
    """One training row as mm_collate_fn's ERNIE-VL branch feeds it (batch 1): kind "image" (the pictures `images`,
    (width, height) each), "text" or "video" ((frames, width, height)). Media laid out as ErnieVLPlugin does
    (`<|IMAGE_START|>` + n placeholders + `<|IMAGE_END|>`, a video between VIDEO_START/END), labels the next token
    of text positions (-100 on vision and marker tokens and at the end), position_ids [b, s, 3] from
    model.get_rope_index, token_type_ids [b, s+1], images/grid_thw from model.get_token_type_ids."""
    import paddle

    rng = np.random.RandomState(seed)
    words = lambda n: list(rng.randint(3, IM_PATCH, n))  # noqa: E731
    ids, pixels, grids, key = [BOS] + words(text[0]), None, None, None
    processor = image_processor()
    if kind == "image":
        out = processor(images=[picture(w, h, seed + i) for i, (w, h) in enumerate(images)], return_tensors="pd")
        pixels, grids, key = out["pixel_values"], out["image_grid_thw"], "image_grid_thw"
        for t, h, w in grids.numpy():
            ids += [IMAGE_START] + [IM_PATCH] * (t * h * w // MERGE ** 2) + [IMAGE_END] + words(2)
    elif kind == "video":
        frames, w, h = video
        out = processor(images=None, videos=clip(frames, w, h, seed + 7), return_tensors="pd")
        pixels, grids, key = out["pixel_values_videos"], out["video_grid_thw"], "video_grid_thw"
        for t, h, w in grids.numpy():
            ids += [VIDEO_START] + [IM_PATCH] * (t * h * w // MERGE ** 2 // TEMPORAL) + [VIDEO_END]
    elif kind != "text":
        raise ValueError(f"unknown kind {kind!r}")
    ids = np.asarray(ids + words(text[1]) + [EOS], np.int64)
    labels = np.roll(ids, -1)  # next-token targets of text positions followed by text, -100 elsewhere
    labels[(ids >= IM_PATCH) | (labels >= IM_PATCH)] = -100
    labels[-1] = -100
    input_ids = paddle.to_tensor(ids[None])
    batch = {"input_ids": input_ids, "labels": paddle.to_tensor(labels[None])}
    rope_args = {key: grids} if grids is not None else {}
    batch["position_ids"] = model.get_rope_index(input_ids, **rope_args)[0].transpose([1, 2, 0])  # [3,b,s]->[b,s,3]
    if grids is None:  # get_token_type_ids concatenates the pictures: it needs one (mm_collate_fn fails likewise)
        batch["token_type_ids"] = paddle.zeros([1, len(ids) + 1], "int64")
        return batch
    image_args = ((pixels, grids, None, None) if kind == "image" else (None, None, pixels, grids))
    types, images, grid_thw = model.get_token_type_ids(input_ids, *image_args)
    batch.update(token_type_ids=paddle.to_tensor(np.asarray(types, np.int64)), images=images,
                 grid_thw=paddle.stack(grid_thw))
    return batch


def batch_of(kind, model, world, seed=0):
    """A batch of `kind` (images: two of different sizes, video, text) whose length 2 x `world` does not divide."""
    kinds = {"images": "image", "video": "video", "text": "text"}
    if kind not in kinds:
        raise ValueError(f"unknown batch kind {kind!r} for ERNIE-VL: use one of {sorted(kinds)}")
    for extra in range(2 * world):
        batch = sample(model, kinds[kind], text=(5, 6 + extra), seed=seed)
        if batch["input_ids"].shape[1] % (2 * world):
            return batch
    raise AssertionError("no uneven length")


def train_step(model, batch):
    """One forward + backward; returns the loss and the trainable parameters left without a gradient."""
    model.clear_gradients(set_to_zero=False)  # None, not zeros: shows who gets no gradient
    batch = {key: value.clone() for key, value in batch.items()}  # the forward rewrites token_type_ids in place
    loss, _ = model(**batch, return_dict=False)
    loss.backward()
    trainable = [(name, p) for name, p in model.named_parameters() if not p.stop_gradient]
    return loss, trainable, [name for name, p in trainable if p.grad is None]


if __name__ == "__main__":
    import paddle
    from paddleformers.utils.log import logger

    logger.set_level("WARNING")

    losses = []
    for run in range(2):
        paddle.seed(0)
        model = build()
        run_losses = []
        for kind in ("image", "text", "video"):
            batch = sample(model, kind)
            loss, trainable, missing = train_step(model, batch)
            run_losses.append(float(loss))
            if run == 0:
                groups = {}
                for name in missing:  # e.g. model.layers.1.mlp.experts (the image experts), vision_model.blocks
                    key = ".".join(name.split(".")[:5 if name.startswith("model.layers") else 2])
                    groups[key] = groups.get(key, 0) + 1
                print(f"{kind}: loss {float(loss):.6f}; trainable {len(trainable)}: with grad "
                      f"{len(trainable) - len(missing)}, without {len(missing)} {groups}")
                print("   ", {k: (list(v.shape), str(v.dtype).split(".")[-1]) for k, v in batch.items()})
        losses.append(run_losses)
    print("losses run 1", losses[0], "\nlosses run 2", losses[1], "\nidentical:", losses[0] == losses[1])
