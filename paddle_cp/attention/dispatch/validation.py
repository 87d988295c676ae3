"""Checks of attention inputs, raised identically on every rank before any collective."""
from __future__ import annotations


def check_inputs(query, key, value, dropout_p, training, enable_gqa=True):
    if dropout_p and training:
        raise ValueError(
            f"attention dropout ({dropout_p}) is not supported under context parallelism: "
            "set the model's attention dropout to 0 (or call it with training=False)"
        )
    if not (query.ndim == key.ndim == value.ndim == 4):
        raise ValueError(
            f"context-parallel attention takes [batch, seq, heads, head_dim] tensors; got q/k/v with "
            f"{query.ndim}/{key.ndim}/{value.ndim} dims"
        )
    (b, s, hq, d), (bk, sk, hk, dk), (bv, sv, hv, _) = query.shape, key.shape, value.shape
    if (b, s, d) != (bk, sk, dk) or (bk, sk, hk) != (bv, sv, hv) or hq % hk:
        raise ValueError(
            f"q, k, v shapes disagree: q {list(query.shape)}, k {list(key.shape)}, v {list(value.shape)}; "
            "k must share q's batch, sequence and head_dim, v k's batch, sequence and heads (its head_dim may "
            "differ), and the k/v head count must divide q's"
        )
    if hq != hk and not enable_gqa:
        raise ValueError(
            f"{hq} query heads and {hk} key/value heads with enable_gqa=False (as Paddle's SDPA, that refuses "
            "grouped-query attention): pass enable_gqa=True or repeat the k/v heads"
        )


def check_sinks(sinks, query):
    if sinks is not None and (sinks.ndim != 1 or sinks.shape[0] != query.shape[2]):
        raise ValueError(
            f"attention sinks must hold one logit per query head ([{query.shape[2]}]), got shape {list(sinks.shape)}"
        )


def check_window(window, is_causal):
    if window is None:
        return
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding window must be a positive int (keys i-w < j <= i), got {window!r}")
    if not is_causal:
        raise ValueError("a sliding window is causal (query i sees keys i-w < j <= i): call with is_causal=True")


def check_mask(attn_mask, query, seq_len):
    b, s, hq, _ = query.shape
    shape = list(attn_mask.shape)
    if len(shape) != 4 or shape[0] not in (1, b) or shape[1] not in (1, hq) or shape[2:] != [s, seq_len]:
        raise ValueError(
            f"under context parallelism attn_mask must hold this rank's query rows against all keys: "
            f"[{b} or 1, 1 or {hq}, {s}, {seq_len}], got {shape}; pass the full [b, 1|h, seq, seq] mask "
            "to the layer PrepareContextParallel splits (it keeps each rank's rows)"
        )


def check_local_length(layout, seq_len, index, local_len):
    expected = len(layout.positions(seq_len, index))
    if expected != local_len:
        raise ValueError(
            f"this rank holds {local_len} tokens but the {layout.backend!r} layout of a {seq_len}-token sequence "
            f"gives it {expected}: split inputs with PrepareContextParallel or paddle_cp.shard_sequence, and pass "
            "seq_len= to the functional attention when the sequence does not divide evenly"
        )


def check_padding(valid, batch, seq_len):
    if valid is not None and tuple(valid.shape) not in ((batch, seq_len), (1, seq_len)):
        raise ValueError(
            f"the padding mask must be [batch, seq_len] = [{batch}, {seq_len}] over the global sequence, "
            f"got {list(valid.shape)}"
        )
