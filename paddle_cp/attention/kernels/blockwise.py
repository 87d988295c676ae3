"""Block attention on any device, fp32, never holding more than one block of scores.

Layouts: q [b, sq, hq, d], k/v [b, sk, hk, d] with hq a multiple of hk (GQA:
q head h reads k/v head h // (hq // hk), as Paddle's SDPA). `causal` means
query i sees key j iff j <= i, with q and k starting at the same position.
Blocks entirely above the diagonal are skipped.
"""
from __future__ import annotations

import paddle

FP32 = paddle.float32


class BlockwiseKernel:
    name = "blockwise"

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

    def _blocks(self, length):
        return [(start, min(start + self.block_size, length)) for start in range(0, length, self.block_size)]

    @staticmethod
    def _visible(q_range, k_range, causal):
        """None: all visible; False: none; else a [Bq, Bk] bool mask."""
        (qs, qe), (ks, ke) = q_range, k_range
        if not causal or ke - 1 <= qs:
            return None
        if ks > qe - 1:
            return False
        rows = paddle.arange(qs, qe).unsqueeze(1)
        cols = paddle.arange(ks, ke).unsqueeze(0)
        return cols <= rows

    @staticmethod
    def _scores(qb, kb, scale, mask):
        """qb [b, hk, g, Bq, d], kb [b, hk, Bk, d] -> [b, hk, g, Bq, Bk]."""
        b, hk, g, bq, d = qb.shape
        s = paddle.matmul(qb.reshape([b, hk, g * bq, d]), kb, transpose_y=True) * scale
        s = s.reshape([b, hk, g, bq, kb.shape[2]])
        if mask is not None:
            s = paddle.where(mask, s, paddle.full([], float("-inf"), FP32))
        return s

    def forward(self, q, k, v, causal, scale):
        """-> out [b, sq, hq, d] fp32, lse [b, hq, sq] fp32."""
        b, sq, hq, d = q.shape
        hk = k.shape[2]
        qg, kh, vh = self._grouped(q, hk), self._heads_first(k), self._heads_first(v)
        outs, lses = [], []
        for q_range in self._blocks(sq):
            qb = qg[:, :, :, q_range[0]:q_range[1]]
            m = l = acc = None
            for k_range in self._blocks(k.shape[1]):
                mask = self._visible(q_range, k_range, causal)
                if mask is False:
                    continue
                kb, vb = kh[:, :, k_range[0]:k_range[1]], vh[:, :, k_range[0]:k_range[1]]
                s = self._scores(qb, kb, scale, mask)
                block_max = s.max(axis=-1, keepdim=True)
                m_new = block_max if m is None else paddle.maximum(m, block_max)
                p = paddle.exp(s - m_new)
                pv = paddle.matmul(p.reshape([b, hk, -1, s.shape[-1]]), vb).reshape(qb.shape)
                if m is None:
                    l, acc = p.sum(axis=-1, keepdim=True), pv
                else:
                    correction = paddle.exp(m - m_new)
                    l = l * correction + p.sum(axis=-1, keepdim=True)
                    acc = acc * correction + pv
                m = m_new
            outs.append(acc / l)
            lses.append((m + paddle.log(l)).squeeze(-1))
        out = paddle.concat(outs, axis=3).reshape([b, hq, sq, d]).transpose([0, 2, 1, 3])
        lse = paddle.concat(lses, axis=3).reshape([b, hq, sq])
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        """Gradients (fp32) given the final out and lse of these queries."""
        b, sq, hq, d = q.shape
        hk = k.shape[2]
        g = hq // hk
        qg, kh, vh = self._grouped(q, hk), self._heads_first(k), self._heads_first(v)
        dog = self._grouped(dout, hk)
        lse_g = lse.astype(FP32).reshape([b, hk, g, sq, 1])
        delta = (dog * self._grouped(out, hk)).sum(axis=-1, keepdim=True)
        k_blocks = self._blocks(k.shape[1])
        dk = [None] * len(k_blocks)
        dv = [None] * len(k_blocks)
        dqs = []
        for q_range in self._blocks(sq):
            qs, qe = q_range
            qb, dob = qg[:, :, :, qs:qe], dog[:, :, :, qs:qe]
            lse_b, delta_b = lse_g[:, :, :, qs:qe], delta[:, :, :, qs:qe]
            rows = g * (qe - qs)
            dq = None
            for i, k_range in enumerate(k_blocks):
                mask = self._visible(q_range, k_range, causal)
                if mask is False:
                    continue
                kb, vb = kh[:, :, k_range[0]:k_range[1]], vh[:, :, k_range[0]:k_range[1]]
                p = paddle.exp(self._scores(qb, kb, scale, mask) - lse_b)
                bk = p.shape[-1]
                p2 = p.reshape([b, hk, rows, bk])
                do2 = dob.reshape([b, hk, rows, d])
                dv_i = paddle.matmul(p2, do2, transpose_x=True)
                dp = paddle.matmul(do2, vb, transpose_y=True).reshape(p.shape)
                ds = (p * (dp - delta_b)).reshape([b, hk, rows, bk]) * scale
                dq_i = paddle.matmul(ds, kb)
                dk_i = paddle.matmul(ds, qb.reshape([b, hk, rows, d]), transpose_x=True)
                dq = dq_i if dq is None else dq + dq_i
                dk[i] = dk_i if dk[i] is None else dk[i] + dk_i
                dv[i] = dv_i if dv[i] is None else dv[i] + dv_i
            dqs.append(dq.reshape([b, hk, g, qe - qs, d]))
        dq = paddle.concat(dqs, axis=3).reshape([b, hq, sq, d]).transpose([0, 2, 1, 3])
        zeros = lambda r: paddle.zeros([b, hk, r[1] - r[0], d], FP32)  # noqa: E731 (keys no query sees)
        dk = paddle.concat([x if x is not None else zeros(r) for x, r in zip(dk, k_blocks)], axis=2)
        dv = paddle.concat([x if x is not None else zeros(r) for x, r in zip(dv, k_blocks)], axis=2)
        return dq, dk.transpose([0, 2, 1, 3]), dv.transpose([0, 2, 1, 3])
