"""Every rank of a data-parallel replica (its `sep` and `mp` ranks) must pass the same full
batch: PrepareContextParallel splits it, each rank keeping its part of one sequence. Ranks
that each draw their own batch (a data-parallel habit) would train silently wrong, so every
forward checks.

A forward that records gradients gathers the rows over every rank of the pipeline stage, not
one replica: a replica whose ranks disagree, or whose batch the plan refuses (a check that
depends on the replica's own batch, e.g. its length or documents), then stops every replica,
instead of the others waiting for it in the gradient all-reduce. A forward without gradients
(an evaluation some replicas may run alone) gathers over its replica only.

When it is read: a forward whose inputs' names, shapes and dtypes (and group) are the ones
this rank last saw agreed, with no refusal, does not wait for the answer: its gathered rows are
copied to the host behind the step (comm/deferred.py) and read at the next forward, before
anything else, so every rank raises the same error there, one forward after the batches
differed, and no step waits for the device. A forward with a new layout (the first, a new
shape, a new plan or group), a refused batch, or documents (read on the host anyway) reads its
rows at once, before any other collective. A rank whose layout changed, or whose batch was
refused, while a peer of its stage kept its last layout raises at once; that peer, already in
the forward's collectives, is stopped by the collective watchdog (comm/watchdog.py), which names
what it waited for.

Cost: an exact integer fingerprint of each input it splits, on the device (comm/
fingerprint.py); one all-gather of SLOTS + 5 int64 per rank; a host read of the gathered rows a
forward later (at once when the layout changed). A recomputed forward (Paddle's recompute
around the whole model) replays the check without gathering again.
"""
from __future__ import annotations

import contextlib
import zlib

import paddle

from .. import runtime
from ..activations import recompute
from ..comm import collectives
from ..comm.deferred import DeferredRead
from ..comm.fingerprint import fingerprint

SLOTS = 4  # value fingerprints per rank: inputs in name order share slot i % SLOTS
TAG = "cp_batch_check"  # its bytes in paddle_cp.bytes_sent()
BATCH_CHECK_GROUPS = (("group", "stage"), ("group", "replica"))  # what BatchCheck reads (ParallelDims.build's needs)


class BatchCheck:
    """The groups a PrepareContextParallel's inputs are compared over, and what one model's forwards left
    to read. Made at apply (its groups from `dims`, a mesh.ParallelDims); one per parallelized model."""

    def __init__(self, dims, pool=False):
        """`pool`: every rank of the stage passes the same global batch (PrepareContextParallel(pool=True)): the
        stage's ranks are compared as one replica, with and without gradients."""
        self.stage = dims.stage
        self.replica_group = dims.replica
        self.replica = dims.position("dp")  # this rank's coordinate along dp (0 without a dp dim)
        self.pool = pool
        if pool:
            self.replica_group, self.replica = self.stage, 0
        self._agreed = None  # (group ranks, header) this rank passed at the last check every rank answered
        self._header = (None, None)  # (header, its int64 tensor): made once per layout, not uploaded per forward
        self._pending = None  # (DeferredRead of the last forward's rows, group ranks, input names)

    def __call__(self, inputs, batch, seq_len, refusal=None, read_now=False):
        """Raise on every rank of the group if the ranks of a replica passed different `inputs` ({name:
        tensor}, the tensors to be split), or if a rank's batch was refused (`refusal`: its ValueError, raised
        there; the others raise one naming its ranks). `read_now`: the batch's own values decide its layout
        (documents), so the answer is read in this forward. Collective: every rank of the group calls it."""
        self.settle()
        group = self.stage if paddle.is_grad_enabled() else self.replica_group
        memo = runtime.state.checked_batches[-1] if runtime.state.checked_batches else None
        if group.size == 1 or (memo is not None and memo.get(id(self))):  # alone, or a recompute replay
            if refusal is not None:
                raise refusal
            return
        names = sorted(inputs)
        layout = repr([(name, list(inputs[name].shape), str(inputs[name].dtype)) for name in names])
        slots = [paddle.zeros([1], "int64") for _ in range(SLOTS)]
        for i, name in enumerate(names):
            slots[i % SLOTS] = slots[i % SLOTS] + fingerprint(inputs[name])
        header = (self.replica, int(refusal is not None), zlib.crc32(layout.encode()), batch, seq_len)
        gathered = paddle.stack(collectives.all_gather(group, paddle.concat([self._header_tensor(header), *slots]),
                                                       tag=TAG))
        if memo is not None:
            memo[id(self)] = True
        if read_now or refusal is not None or self._agreed != (group.ranks, header):
            self._agreed = None  # until every rank's answer is in: after an error the next forward reads at once
            _raise_for(gathered.numpy().tolist(), group.ranks, names, refusal, self.pool)
            self._agreed = (group.ranks, header)
        else:
            self._pending = (DeferredRead(gathered), group.ranks, names, self.pool)

    def settle(self):
        """Read the rows the last forward gathered without waiting for them: raise as it would have."""
        if self._pending is not None:
            (rows, ranks, names, pool), self._pending = self._pending, None
            try:
                _raise_for(rows.result().tolist(), ranks, names, pool=pool)
            except ValueError:
                self._agreed = None
                raise

    def _header_tensor(self, header):
        if self._header[0] != header:
            self._header = (header, paddle.to_tensor(list(header), dtype="int64"))
        return self._header[1]


def _raise_for(rows, ranks, names, refusal=None, pool=False):
    """The verdict on the gathered `rows` (one per rank of `ranks`, mesh order), the same on every rank:
    raise this rank's `refusal`, or an error naming the ranks that differ or refused."""
    replicas = {}
    for rank, row in zip(ranks, rows):  # {replica: [(rank, row after replica and refusal)]}, mesh order
        replicas.setdefault(row[0], []).append((rank, row[2:]))
    for members in replicas.values():
        _raise_unless_equal(members, names, POOL_FIX if pool else REPLICA_FIX)
    refused = [rank for rank, row in zip(ranks, rows) if row[1]]
    if refusal is not None:
        raise refusal
    if refused:
        raise ValueError(f"context parallel: ranks {refused} refused their batch (their error says why); this "
                         "rank stops too, so that none waits for them in a collective")


REPLICA_FIX = ("the ranks of a data-parallel replica", "Every rank of a replica (its sep and mp ranks) must pass the same "
               "full batch, which PrepareContextParallel splits; give each data-parallel replica its own batch over a "
               "`dp` mesh dim (pcp.shard_dataloader / pcp.shard_batch) and the same batch to the ranks of its sep group")
POOL_FIX = ("the ranks of a PrepareContextParallel(pool=True) pool", "Every rank of the dp x sep pool must pass the "
            "global batch (every replica's rows, the same on every rank), which the pool lays out over all of them: "
            "do not shard the data over dp (no pcp.shard_dataloader / shard_batch), or drop pool=True")


def _raise_unless_equal(members, names, fix=REPLICA_FIX):
    """`members`: [(rank, row)] of one replica; `fix`: (who they are, what they must do)."""
    who, must = fix
    first = members[0][1]
    if all(row[0] == first[0] for _, row in members):
        differ = sorted({name for _, row in members for i, name in enumerate(names)
                         if row[3 + i % SLOTS] != first[3 + i % SLOTS]})
        if not differ:
            return
        ranks = [rank for rank, row in members if row != first]
        raise ValueError(f"context parallel: {who} passed different values of {differ} (ranks {ranks} differ from "
                         f"rank {members[0][0]}). {must}")
    shapes = ", ".join(f"rank {rank}: batch {row[1]} x {row[2]} tokens" for rank, row in members)
    raise ValueError(f"context parallel: {who} passed inputs of different names, shapes or dtypes ({shapes}). {must}")


@contextlib.contextmanager
def _checking_once(memo):
    runtime.state.checked_batches.append(memo)
    try:
        yield
    finally:
        runtime.state.checked_batches.pop()


def _capture():
    """A recompute call made outside any batch (around a whole model) shares one memo between its
    forward and its replay; one made inside a model's forward cannot re-run that model's check."""
    if runtime.state.batches.running:
        return None
    memo = {}
    return lambda: _checking_once(memo)


recompute.carry(_capture)
