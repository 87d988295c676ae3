"""Block attention on any device, fp32, never holding more than one tile of scores.

It computes in fp32 whatever the inputs' dtype and whatever autocast the caller runs under, forward and
backward alike (full_precision.py); its results are fp32 (merges take them so), the caller casts them back.

Layouts: q [b, sq, hq, d], k/v [b, sk, hk, d] with hq a multiple of hk (GQA:
q head h reads k/v head h // (hq // hk), as Paddle's SDPA). Which keys a query
sees comes from a BlockMask (mask.py): the same row bounds as the flash kernels
take say which tiles no query sees (skipped) and which need no mask. A query
that sees no key gets output 0 and log-sum-exp -inf, so partial results merge.
"""
from __future__ import annotations

import paddle

from .full_precision import fp32_inside
from ..masks.block_mask import record_work

FP32 = paddle.float32
NEG_INF = float("-inf")


def _finite(x):
    """-inf (a row with nothing seen yet) -> 0, so exp(s - x) stays 0 instead of nan."""
    return paddle.where(paddle.isinf(x), paddle.zeros_like(x), x)


class BlockwiseKernel:
    name = "blockwise"

    @staticmethod
    def supports(mask, q, v):
        """Any block: fp32 tiles on any device, dtype, head dims and mask."""
        return True

    def __init__(self, block_size=512):
        self.block_size = block_size

    # q [b, s, hq, d] -> [b, hk, g, s, d], the GQA groups next to their k/v head
    @staticmethod
    def _grouped(x, hk):
        b, s, h, d = x.shape
        return x.astype(FP32).transpose([0, 2, 1, 3]).reshape([b, hk, h // hk, s, d])

    @staticmethod
    def _heads_first(x):
        return x.astype(FP32).transpose([0, 2, 1, 3])

    def _tile_size(self, window):
        # Tiles no longer than a sliding window (not below 32 rows) let the mask skip what it hides.
        return self.block_size if window is None else min(self.block_size, max(window, 32))

    @staticmethod
    def _scores(qb, kb, scale, mask):
        """qb [b, hk, g, Bq, d], kb [b, hk, Bk, d] -> [b, hk, g, Bq, Bk]; mask [b|1, 1|hq, Bq, Bk]."""
        b, hk, g, bq, d = qb.shape
        s = paddle.matmul(qb.reshape([b, hk, g * bq, d]), kb, transpose_y=True) * scale
        s = s.reshape([b, hk, g, bq, kb.shape[2]])
        if mask is None:
            return s
        heads = mask.shape[1]
        mask = mask.unsqueeze(1) if heads == 1 else mask.reshape([mask.shape[0], hk, g, *mask.shape[2:]])
        if mask.dtype == paddle.bool:
            return paddle.where(mask, s, paddle.full([], NEG_INF, FP32))
        return s + mask.astype(FP32)

    def _plan(self, mask, record):
        """[(q tile, [(k tile, tile mask or None), ...]), ...] for the tiles anyone sees (the block's plan,
        made once per batch: BlockMask.tile_plan); tile masks are made on the device as they are reached."""
        plan, computed = mask.tile_plan(self._tile_size(mask.window))
        if record:
            record_work(computed, len(mask.q_pos) * len(mask.k_pos))
        for q_tile, seen in plan:
            yield q_tile, ((k_tile, None if full else mask.tile(q_tile, k_tile)) for k_tile, full in seen)

    @fp32_inside
    def forward(self, q, k, v, mask, scale):
        """-> out [b, sq, hq, dv] fp32, lse [b, hq, sq] fp32 (dv: v's head dim, may differ from q/k's)."""
        b, sq, hq, _ = q.shape
        hk, dv = k.shape[2], v.shape[3]
        qg, kh, vh = self._grouped(q, hk), self._heads_first(k), self._heads_first(v)
        outs, lses = [], []
        for (qs, qe), seen in self._plan(mask, record=True):
            qb = qg[:, :, :, qs:qe]
            m = paddle.full([b, hk, hq // hk, qe - qs, 1], NEG_INF, FP32)
            l, acc = paddle.zeros(m.shape, FP32), paddle.zeros([b, hk, hq // hk, qe - qs, dv], FP32)
            for (ks, ke), tile_mask in seen:
                s = self._scores(qb, kh[:, :, ks:ke], scale, tile_mask)
                m_new = paddle.maximum(m, s.max(axis=-1, keepdim=True))
                p = paddle.exp(s - _finite(m_new))
                pv = paddle.matmul(p.reshape([b, hk, -1, ke - ks]), vh[:, :, ks:ke]).reshape(acc.shape)
                correction = paddle.exp(m - _finite(m_new))
                l = l * correction + p.sum(axis=-1, keepdim=True)
                acc = acc * correction + pv
                m = m_new
            # Paddle's CPU exp(-inf) is ~3e-39, not 0: rows that saw nothing are set, not divided.
            empty = paddle.isinf(m)
            outs.append(paddle.where(empty, paddle.zeros_like(acc), acc / paddle.where(empty, paddle.ones_like(l), l)))
            lses.append(paddle.where(empty, m, m + paddle.log(l)).squeeze(-1))
        # [b, hk, g, sq, dv] -> [b, sq, hq, dv]
        out = paddle.concat(outs, axis=3).reshape([b, hq, sq, dv]).transpose([0, 2, 1, 3])
        lse = paddle.concat(lses, axis=3).reshape([b, hq, sq])
        return out, lse

    @fp32_inside
    def backward(self, dout, q, k, v, out, lse, mask, scale):
        """Gradients (fp32) given the final out and lse of these queries (lse may include sinks).

        With S = scale * q k^T (masked), L = lse, O = out and dO = dout:
          (1) P  = exp(S - L)             the final probabilities, recomputed per tile
          (2) D  = rowsum(dO * O)         one number per query
          (3) dP = dO v^T
          (4) dS = P * (dP - D)           softmax backward, D standing for sum_j P dP
          (5) dq = scale * dS k,  dk = scale * dS^T q,  dv = P^T dO
        """
        b, sq, hq, d = q.shape
        hk, dv_dim = k.shape[2], v.shape[3]
        g = hq // hk
        qg, kh, vh = self._grouped(q, hk), self._heads_first(k), self._heads_first(v)
        dog = self._grouped(dout, hk)
        lse_g = _finite(lse.astype(FP32)).reshape([b, hk, g, sq, 1])
        delta = (dog * self._grouped(out, hk)).sum(axis=-1, keepdim=True)  # (2)
        dk = paddle.zeros(kh.shape, FP32)
        dv = paddle.zeros(vh.shape, FP32)
        dqs = []
        for (qs, qe), seen in self._plan(mask, record=False):
            qb, dob = qg[:, :, :, qs:qe], dog[:, :, :, qs:qe]
            lse_b, delta_b = lse_g[:, :, :, qs:qe], delta[:, :, :, qs:qe]
            rows = g * (qe - qs)
            dq = paddle.zeros(qb.shape, FP32)
            for (ks, ke), tile_mask in seen:
                kb, vb = kh[:, :, ks:ke], vh[:, :, ks:ke]
                p = paddle.exp(self._scores(qb, kb, scale, tile_mask) - lse_b)  # (1)
                p2 = p.reshape([b, hk, rows, ke - ks])  # GQA groups' rows stacked: [b, hk, g*Bq, Bk]
                do2 = dob.reshape([b, hk, rows, dv_dim])
                dp = paddle.matmul(do2, vb, transpose_y=True).reshape(p.shape)  # (3)
                ds = (p * (dp - delta_b)).reshape([b, hk, rows, ke - ks]) * scale  # (4), scaled for (5)
                dq = dq + paddle.matmul(ds, kb).reshape(qb.shape)  # (5)
                dk[:, :, ks:ke] += paddle.matmul(ds, qb.reshape([b, hk, rows, d]), transpose_x=True)  # (5)
                dv[:, :, ks:ke] += paddle.matmul(p2, do2, transpose_x=True)  # (5)
            dqs.append(dq)
        # [b, hk, g, sq, d] -> [b, sq, hq, d]
        dq = paddle.concat(dqs, axis=3).reshape([b, hq, sq, d]).transpose([0, 2, 1, 3])
        return dq, dk.transpose([0, 2, 1, 3]), dv.transpose([0, 2, 1, 3])
