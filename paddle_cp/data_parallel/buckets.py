"""Gradient buckets: gradients reduced while backward runs, in one order on every rank.

At parallelize the trained parameters held here are cut into buckets of at most `bucket_size_mb`
(dp_config; DEFAULT_BUCKET_MB) in the reverse of the model's order, about the order backward writes
their gradients. A hook that runs after a parameter's gradient is accumulated
(`Tensor._register_backward_hook`, the one Paddle's DataParallel reducer and group-sharded stages use)
marks it arrived; a bucket whose members have all received their last gradient of the step is reduced
at once, as `step()` would reduce it: each reduction its members' placements ask for
(`ParamRecord.reductions`), phase by phase, each phase's groups in the order of their kinds, so each
gradient is summed in the same order as before. Levels 2-3 reduce-scatter the bucket onto the owners
and free its full gradients then: the rank keeps only the shares it owns. On NCCL the collectives are
issued with `sync_op=False` (a bucket is waited for when the next one is issued, or in `step()`); on
gloo they block, in order. The reduced gradients are put on the parameters by `step()` (or
`reduce_gradients()`); until then a reduced parameter's `.grad` is None.

"Its last gradient of the step" is learned, on the host, from the step before: how many backward
passes a step makes (a pass: a backward call in which a member's gradient arrived, ended by a final
backward hook) and in which pass each member's gradient last arrived. So gradient accumulation (k
backwards per step) and recompute (a backward per segment) reduce after the last one; with k > 1 the
gradients stay whole until the last backward (reduced once per step, not once per backward). The first
step, and any step whose pattern differs (fewer passes, a member not arriving), reduce what is left in
`step()`; a step with more passes than learned reduces each bucket a second time with what arrived
after its first reduction (a round of zeros where nothing did), so every rank still issues the same
collectives (every rank makes the same backward calls: the script's).

Every rank issues the buckets in one fixed order: first those that may be reduced during backward, in
index order (one not ready holds back those after it), then those reduced only in `step()`, in index
order. A bucket is reduced only in `step()` when it holds
- a parameter of a fetch unit whose sublayers run by the data (experts: which run, on which ranks,
  depends on the routing, so the point in backward where the bucket completes differs between ranks, and a blocking gloo
  collective there could wait on a peer that waits in an attention exchange);
- a parameter no rank had a gradient for at the first step: which ranks have one is agreed then, in
  one all-reduce per group read on the host, and again every step for such a bucket only (one card
  gives such a parameter no gradient, so it must not get zeros). Otherwise a parameter missing here is
  reduced as zeros, with no host read: that is one card's gradient, which `clear_grad()` zeroes
  (`clear_grad(set_to_zero=False)` leaves None instead: presence is agreed again at the next step);
- a parameter some ranks had a gradient for and others not at an agreement (a branch a rank takes by its
  tokens, a MoE block's experts no token of a rank reached): reduced during backward where it arrived, the all-reduce
  would hold those ranks while the others' backward still exchanges with them (ring attention), a deadlock;
  a rank missing it reduces zeros. Presence that first differs after the agreements is not seen: a family
  whose parameters run by the data marks them (a fetch unit, as ExpertParallel's experts);
- or when an enabled GradScaler drives the optimizer (`shard_scaler` turns overlap off: the scaler's
  step reads and may change gradients between backward and step, as the scaler tests inject infs), or
  under a pipeline (the factor a script puts on a scheduled step's loss is known only after the
  schedule's backwards and may differ between dp replicas: it must reach the gradients before they are
  summed, optimizer.py; parallelize makes a pipeline's parameters one bucket).
"""
from __future__ import annotations

import math

import paddle
from paddle.amp.auto_cast import amp_global_state
from paddle.base import core

from ..comm import collectives
from ..comm.counters import nbytes, shape_nbytes
from ..dtypes import LOW_PRECISION
from ..params import SHARDING, Owned, is_fetch_unit, record_of
from .held_bytes import HeldBytes

DEFAULT_BUCKET_MB = 25  # Paddle DataParallel's comm_buffer_size
MB = 1 << 20
ALL_REDUCE_TAGS = {"avg": "grad_all_reduce", "sum": "grad_sum_all_reduce"}


def bucket_size_mb(dp_config):
    """dp_config's `bucket_size_mb` (a positive number), DEFAULT_BUCKET_MB when absent."""
    size = (dp_config or {}).get("bucket_size_mb", DEFAULT_BUCKET_MB)
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0 or not math.isfinite(size):
        raise ValueError(f"dp_config bucket_size_mb must be a positive number of MiB (default {DEFAULT_BUCKET_MB}), "
                         f"got {size!r}")
    return size


def local_nbytes(param):
    """Bytes of this rank's reduced gradient of `param`, from its shape (a level-3 placeholder has none) and
    `gradient_dtype` (fp32 master gradients of a bf16 parameter are 4 bytes an element)."""
    return shape_nbytes(record_of(param).local_shape(), gradient_dtype(param))


def reduced(param):
    """Whether `param`'s gradient may be reduced: trained, held here, placed over a group of more than one rank
    (a sequence-parallel plan marks partial gradients over mp only in the first forward)."""
    record = record_of(param)
    return not param.stop_gradient and record.held_here() and any(p.group.size > 1 for p in record.placements)


def plan_buckets(model, params, size_mb):
    """([[param]] the buckets, in issue order; {id(param)} of those only `step()` may reduce): `params` that may
    be reduced, in the reverse of their order, cut into runs of at most `size_mb` MiB (a larger one alone);
    a fetch unit's (experts: which ones a rank holds, and their sizes, differ between ranks that reduce the
    other parameters together) in runs of their own, after the others. Only shapes and placements: the same
    on every rank that reduces a bucket."""
    in_units = {id(p) for layer in model.sublayers(include_self=True) if is_fetch_unit(layer, runs_by_data=True)
                for p in layer.parameters()}
    reduced_here = [p for p in params if reduced(p)]
    step_only = {id(p) for p in reduced_here if id(p) in in_units}
    return _cut_in_order([p for p in reversed(reduced_here)], step_only, size_mb), step_only


def _cut_in_order(ordered, step_only, size_mb):
    """`ordered` (issue order) cut into runs of at most `size_mb` MiB (a larger one alone), those `step_only`
    holds after the others, in runs of their own."""
    buckets = []
    for part in ([p for p in ordered if id(p) not in step_only], [p for p in ordered if id(p) in step_only]):
        buckets += cut_runs(part, local_nbytes, size_mb)
    return buckets


def cut_runs(ordered, nbytes, size_mb):
    """`ordered` (issue order) cut into runs of at most `size_mb` MiB of `nbytes(param)` each (a larger
    parameter alone)."""
    runs, size = [], 0
    for param in ordered:
        param_bytes = nbytes(param)
        if not runs or size + param_bytes > size_mb * MB:
            runs.append([])
            size = 0
        runs[-1].append(param)
        size += param_bytes
    return runs


def gradient_dtype(param):
    """The dtype of `param`'s reduced gradient, the same on every rank: float32 for a float16/bfloat16
    parameter under `paddle.amp.decorate(master_grad=True)` (Paddle casts those gradients at the end of
    backward), else the parameter's. A gradient made here (a branch this rank did not take) or reduced
    during backward (before Paddle's cast) gets it too, so every rank fills buffers of the same dtypes."""
    if param.dtype in LOW_PRECISION and amp_global_state().use_master_grad:
        return paddle.float32
    return param.dtype


def _refuse_main_grad(params):
    """Paddle's `MixPrecisionLayer` (fleet's mix_precision_utils; PaddleFormers' Trainer applies it with
    `amp_master_grad` outside its auto-parallel mode) moves each gradient into `param.main_grad` and clears
    `.grad`: the buckets would reduce zeros while every rank steps its own main_grad. Refused (the same
    parameters on every rank, before any collective); `decorate(master_grad=True)` gives the same fp32
    gradients on `.grad`."""
    held = [p.name for p in params if hasattr(p, "main_grad")]
    if held:
        raise ValueError(f"{held[0]} has a `main_grad` (Paddle's MixPrecisionLayer): paddle_cp reduces `.grad`, "
                         "which MixPrecisionLayer empties. Use paddle.amp.decorate(..., level='O2', "
                         "master_grad=True) instead (fp32 gradients on `.grad`, accumulated and reduced in fp32)")


def _gradient_dtypes(buckets):
    return [gradient_dtype(p) for b in buckets for p in b.params]


class _Bucket:
    def __init__(self, index, params, early):
        self.index, self.params, self.early = index, params, early  # early: no member only step() may reduce
        self.dead = set()  # ids of members no rank had a gradient for, at the last agreement
        self.uneven = False  # a member some ranks had a gradient for and others not, at an agreement: step() only
        self.rounds = 0  # reductions issued this step
        self.values = {}  # id(param) -> its reduced gradient (summed over the rounds)
        self.pending = None  # the last reduction's finishing work, run after its collective completes

    @property
    def overlaps(self):
        """Whether backward may reduce it (the same on every rank: placements and an agreed presence)."""
        return self.early and not self.dead and not self.uneven


class GradientBuckets:
    """The buckets of one optimizer's parameters and their state within a step."""

    def __init__(self, buckets, step_only, gradients, size_mb=math.inf):
        self.gradients = gradients  # OwnGradients or the Sharding (a level-3 non-owner's are stashed)
        self._step_only, self._size_mb = step_only, size_mb
        self._lay_out(buckets)
        for bucket in self.buckets:
            for param in bucket.params:
                _follow(param, self)
        self.overlap = True  # False once an enabled GradScaler drives the optimizer
        self.agreed = False  # which members have a gradient somewhere: agreed at the first step
        self._cut_under = None  # use_master_grad when the dtypes were last compared with the cut's (None: never)
        self.recheck = False  # and at the next step after clear_grad(set_to_zero=False)
        self.grad_bytes = HeldBytes()  # gradients unreduced, and reduced ones kept for `step()`
        # (bucket index, member gradients arrived so far, pass) of each bucket issued during backward, this step
        # (kept until the next step's first gradient arrives)
        self.issue_log = []
        self._passes_learned = None  # backward passes of the last step
        self._last_pass = {}  # id(param) -> the pass its gradient last arrived in, last step
        self._new_step()

    def _lay_out(self, buckets):
        self.buckets = [_Bucket(i, params, not any(id(p) in self._step_only for p in params))
                        for i, params in enumerate(buckets)]
        self._order = self._fixed_order()
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._cut_for = _gradient_dtypes(self.buckets)

    def _recut_for_new_dtypes(self):
        """`paddle.amp.decorate` after parallelize changed the gradients' dtypes the buckets were cut for (fp32):
        cut again by the new sizes (between steps, the same on every rank: dtypes, shapes and placements), and
        agree again which members have a gradient somewhere at the next step. Compared (a pass over every
        parameter) after the first step, and after a step where decorate's master_grad switch changed; a cast
        after the first step otherwise keeps the cut: only the buckets' sizes are off (each gradient is still
        reduced in its own dtype, one flat buffer per dtype)."""
        master_grad = amp_global_state().use_master_grad
        if self._cut_under == master_grad:
            return
        self._cut_under = master_grad
        if _gradient_dtypes(self.buckets) == self._cut_for:
            return
        ordered = [p for b in self.buckets for p in b.params]
        self._lay_out(_cut_in_order(ordered, self._step_only, self._size_mb))
        self.agreed = False

    def _fixed_order(self):
        return [b for b in self.buckets if b.overlaps] + [b for b in self.buckets if not b.overlaps]

    def _new_step(self):
        self.arrivals = 0  # member gradients arrived this step: the backward position of an issue
        self.passes = 0
        self._in_pass = False
        self._arrived_in = {}  # id(param) -> pass of its latest arrival this step
        self._counted = {}  # id(param) -> bytes of its unreduced gradient counted in grad_bytes
        self._next = 0  # index in _order of the next bucket to reduce
        self._in_flight = None
        self._late = False  # a gradient arrived for a bucket reduced already
        for bucket in self.buckets:
            bucket.rounds, bucket.values, bucket.pending = 0, {}, None

    # backward ------------------------------------------------------------------------------

    def _arrived(self, param):
        bucket = self._bucket_of.get(id(param))
        if bucket is None:  # a newer optimizer over the model left this parameter out: it reduces it no more
            return
        if not self.arrivals:
            self.issue_log = []
        if not self._in_pass:
            self._in_pass = True
            self.passes += 1
            core.eager._add_backward_final_hook(self._pass_ended)  # Paddle drops it after this backward
        key = id(param)
        self.arrivals += 1
        self._arrived_in[key] = self.passes
        if key not in self._counted:
            self._counted[key] = self._unreduced_bytes(param)
            self.grad_bytes.add(self._counted[key])
        if bucket.rounds:
            self._late = True
        elif self._ready_to_overlap():
            self._issue_ready()

    def _pass_ended(self):
        self._in_pass = False

    def _ready_to_overlap(self):
        return self.overlap and self.agreed and self._passes_learned is not None and not self._late \
            and self.passes <= self._passes_learned

    def _complete(self, bucket):
        """Every member's gradient arrived in the pass it last arrived in, last step."""
        return all(self._last_pass.get(id(p)) is not None and self._arrived_in.get(id(p)) == self._last_pass[id(p)]
                   for p in bucket.params)

    def _issue_ready(self):
        while self._next < len(self._order):
            bucket = self._order[self._next]
            if not (bucket.overlaps and self._complete(bucket)):
                return
            self.issue_log.append((bucket.index, self.arrivals, self.passes))
            self._reduce(bucket)
            self._next += 1

    # step ----------------------------------------------------------------------------------

    def reduce_rest(self):
        """Reduce what backward did not, in the fixed order; a step with more passes than learned reduces the
        early buckets again (the first step agrees which members have a gradient somewhere first)."""
        if not self.agreed:  # the first step's (MixPrecisionLayer wraps a model before it trains): before any reduction
            _refuse_main_grad([p for b in self.buckets for p in b.params])
        late = self._late or (self._passes_learned is not None and self.passes > self._passes_learned)
        for position, bucket in enumerate(self._order):
            if position >= self._next:
                if not self.agreed or bucket.dead or self.recheck:
                    self._agree(bucket)
                self._reduce(bucket)
            elif self.recheck:
                self._agree(bucket)
            if late and bucket.overlaps:
                self._reduce(bucket)  # what arrived after its first round (zeros on a rank where nothing did)
        self._next = len(self._order)

    def install(self):
        """Put the reduced gradients on the parameters (non-owners' were freed). Learns this step's pattern for
        the next and starts a new step."""
        self._finish_in_flight()
        for bucket in self.buckets:
            for param in bucket.params:
                value = bucket.values.get(id(param))
                if value is not None and id(param) not in bucket.dead:  # else another rank owns it, or no rank used it
                    value = value.reshape(record_of(param).local_shape())
                    param._set_grad_ivar(value)
        if not self.agreed or self.recheck:
            self.agreed, self.recheck, self._order = True, False, self._fixed_order()
        self._passes_learned, self._last_pass = self.passes, dict(self._arrived_in)
        held = sum(nbytes(v) for b in self.buckets for v in b.values.values())
        self.grad_bytes.held = held  # now on the parameters (what the optimizer steps on)
        self._recut_for_new_dtypes()
        self._new_step()

    def clear(self, set_to_zero=True):
        """Forget this step's gradients (a step skipped, clear_grad before step). Cleared to None (not zeros), a
        gradient one card does not write next step stays None there and its parameter is not stepped: which
        members have one is agreed again in the next step() (buckets still reduced during backward)."""
        self.recheck = not set_to_zero
        self._finish_in_flight()
        self.grad_bytes.held = 0
        self._new_step()

    # one reduction of a bucket ---------------------------------------------------------------

    def _finish_in_flight(self):
        if self._in_flight is not None:
            self._in_flight.pending()
            self._in_flight.pending, self._in_flight = None, None

    def _reduce(self, bucket):
        """Issue every reduction of the bucket's gradients; the last one's finishing work (average, split into
        the members' gradients) runs when the next bucket is issued or in step(). Placements are read now: a
        sequence-parallel plan marks partial gradients during the first forward."""
        self._finish_in_flight()
        steps = _steps(bucket.params)
        in_steps = {id(p) for *_, members in steps for p in members}
        reduced = [p for p in bucket.params if id(p) in in_steps]
        values, freed = {}, 0
        for param in reduced:
            grad, dtype = self.gradients.gradient(param), gradient_dtype(param)
            if has_gradient(grad):
                values[id(param)] = grad if grad.dtype == dtype else grad.astype(dtype)
            else:
                values[id(param)] = paddle.zeros(record_of(param).local_shape(), dtype)
        finishing = []
        for phase, group, op, members in steps:
            for finish in finishing:
                finish()  # the previous collective's result is an input of this one
            members = [p for p in members if id(p) in values]  # after the reduce-scatter: the owned ones
            reduce = _reduce_scatter if phase == SHARDING else _all_reduce
            finishing = reduce(group, members, values, op) if members else []
        for param in reduced:  # the first collective's buffers hold them now
            self.gradients.release(param)
            freed += self._counted.pop(id(param), 0)
        self.grad_bytes.add(-freed)
        first_round = bucket.rounds == 0
        bucket.rounds += 1

        def pending():
            for finish in finishing:
                finish()
            kept = 0
            for key, value in values.items():
                if first_round:
                    bucket.values[key] = value
                    kept += nbytes(value)
                else:
                    bucket.values[key] = bucket.values[key] + value
            self.grad_bytes.add(kept)

        bucket.pending = pending
        self._in_flight = bucket

    def _unreduced_bytes(self, param):
        grad = self.gradients.gradient(param)
        return nbytes(grad) if has_gradient(grad) else 0

    def _agree(self, bucket):
        """Which members have a gradient on some rank sharing them: one all-reduce per group of their
        reductions, read on the host (the first step; then every step for a bucket with such a member)."""
        present = {id(p): int(id(p) in self._arrived_in or has_gradient(self.gradients.gradient(p)))
                   for p in bucket.params}  # arrived: a bucket reduced during backward released it already
        for _, group, _, members in _steps(bucket.params):
            counts = paddle.to_tensor([present[id(p)] for p in members], dtype="int32")
            collectives.all_reduce(group, counts, tag="grad_presence")
            for param, count in zip(members, counts.numpy().tolist()):
                present[id(param)] = int(count > 0)
                bucket.uneven = bucket.uneven or 0 < count < group.size
        bucket.dead = {key for key, count in present.items() if not count}


_FOLLOWER = "_pcp_gradient_buckets"


def _follow(param, buckets):
    """Make `buckets` the ones `param`'s gradient arrivals go to: the latest optimizer built over it (one hook
    per parameter, so an optimizer built again does not leave an old one reducing and freeing its gradients)."""
    if not hasattr(param, _FOLLOWER):
        param._register_backward_hook(lambda: getattr(param, _FOLLOWER)._arrived(param))
    setattr(param, _FOLLOWER, buckets)


def has_gradient(grad):
    """A gradient with values (a cleared one is uninitialized; a level-3 non-owner's on the parameter is empty)."""
    return grad is not None and grad._is_initialized() and math.prod(grad.shape) > 0


def _steps(params):
    """(phase, group, op, members) of every reduction the parameters' placements ask for, in the order they run:
    by phase, then by the group's kind (MeshGroup.kind), the same on every rank."""
    steps = {}
    for param in params:
        for r in record_of(param).reductions():
            if r.group.size > 1:
                key = (r.phase, r.group.kind, r.group.ranks, r.op)
                steps.setdefault(key, (r.group, []))[1].append(param)
    return [(key[0], group, key[3], members) for key, (group, members) in sorted(steps.items(), key=lambda i: i[0])]


def _by_dtype(members, values):
    by_dtype = {}
    for param in members:
        by_dtype.setdefault(values[id(param)].dtype, []).append(param)
    return by_dtype


def _all_reduce(group, members, values, op):
    """Sum (or average) the members' values over `group`, one flat buffer per dtype; returns the work that
    finishes it (after the collective completes: average, split back)."""
    finishing = []
    for same_dtype in _by_dtype(members, values).values():
        flat = paddle.concat([values[id(p)].reshape([-1]) for p in same_dtype])
        for p in same_dtype:
            values[id(p)] = None  # the flat buffer holds them now
        handle = collectives.all_reduce_async(group, flat, tag=ALL_REDUCE_TAGS[op])

        def finish(flat=flat, same_dtype=same_dtype, handle=handle):
            handle.wait()
            total = flat / group.size if op == "avg" else flat
            sizes = [math.prod(record_of(p).local_shape()) for p in same_dtype]
            for param, part in zip(same_dtype, paddle.split(total, sizes)):
                values[id(param)] = part
        finishing.append(finish)
    return finishing


def _reduce_scatter(group, members, values, op):
    """Levels 2-3: each owner receives the average of its members' values over `group`: chunk r holds position
    r's members (one reduce-scatter per dtype; owners are balanced over the whole model, not per bucket, so the
    chunks differ: on NCCL padded to the largest where that moves no more bytes, else one reduce per owner
    present, collectives.reduce_scatter). The full values are dropped at once; after it only this position's
    members keep a value."""
    n, finishing = group.size, []
    for dtype, same_dtype in _by_dtype(members, values).items():
        owners = [[p for p in same_dtype if _owner(p) == r] for r in range(n)]
        # a position owning none of them gets an empty chunk: nothing is reduced onto it
        chunks = [paddle.concat([values[id(p)].reshape([-1]) for p in b]) if b else paddle.zeros([0], dtype)
                  for b in owners]
        for p in same_dtype:
            del values[id(p)]
        mine, handle = collectives.reduce_scatter_async(group, chunks, tag="grad_reduce_scatter")

        def finish(mine=mine, handle=handle, own=owners[group.index], chunks=chunks):
            handle.wait()
            chunks.clear()  # kept until the collective completed (NCCL reads them on its stream)
            if own:
                sizes = [math.prod(record_of(p).local_shape()) for p in own]
                for param, part in zip(own, paddle.split(mine / n if op == "avg" else mine, sizes)):
                    values[id(param)] = part
        finishing.append(finish)
    return finishing


def _owner(param):
    return next(p for p in record_of(param).placements if isinstance(p, Owned)).owner
