"""The optimizer `parallelize` returns: reduces gradients over the right groups, clips, steps.

Rule: every rank takes the mean loss over its own tokens; gradients of
parameters replicated over `dp` and `sep` are averaged over those ranks, so with
equal token counts per rank this reproduces one card on the global batch.
Parameters used while the sequence is split over `mp` (sequence parallelism)
saw only this rank's tokens, and a LoRA factor beside a split weight only this
rank's slice of it: their gradients are summed over `mp`; a parameter held by
several pipeline stages is summed over them. Which group does what comes from
each parameter's placements (`ParamRecord.reductions`, params.py). Frozen
parameters (no gradient on any rank) are skipped.
`ClipGradByGlobalNorm` clips by the norm over all shards, every gradient
counted once (`ParamRecord.chosen_here`: each shard's piece on one of the ranks
holding it). Under dp_config `offload_optimizer` the clipped gradients are stepped on the host
(host_optimizer.py), the state held there.
"""
from __future__ import annotations

import math

import paddle

from .. import runtime
from ..comm import collectives
from ..params import record_of
from .buckets import GradientBuckets, gradient_dtype  # noqa: F401 (gradient_dtype: imported from here too)


class OwnGradients:
    """Where this rank's gradient of each parameter is: its `.grad` (sharding level 3 keeps a non-owner's
    elsewhere: Sharding answers the same two questions)."""

    @staticmethod
    def gradient(param):
        return param.grad

    @staticmethod
    def release(param):
        """Free it: its bucket holds it now."""
        if param.grad is not None:
            param.clear_gradient(False)


def optimizer_parameters(optimizer):
    """The optimizer's parameters, flattening parameter groups."""
    if getattr(optimizer, "_param_groups", None) and isinstance(optimizer._param_groups[0], dict):
        return [p for group in optimizer._param_groups for p in group["params"]]
    return list(optimizer._parameter_list)


class ParallelOptimizer(paddle.optimizer.Optimizer):
    """Wraps a Paddle optimizer. Every attribute but its own (below) is the inner optimizer's, read
    and written (`_multi_precision`, `_learning_rate`, `get_lr`, `state_dict`, ...), so parameter
    groups keep their own learning rate, weight decay and clip, and `paddle.amp.decorate` and
    `GradScaler` see the optimizer they expect. A subclass of Paddle's Optimizer (never initialized
    as one) only so that isinstance checks such as decorate's accept it, as Paddle's own wrapper does.

    Gradients are reduced in buckets (buckets.py): during the backward that writes a bucket's last
    gradient of the step, or else in `step()` (or earlier, in `reduce_gradients()`, when
    `pcp.shard_scaler`'s unscale needs the reduced gradients): micro-batches accumulated with several
    backwards before one `step()` are reduced once, after the last, as one card sums them.
    """

    def __init__(self, optimizer, world, sharding=None, loss_factor=None, buckets=((), frozenset(), math.inf),
                 host=None):
        own = object.__setattr__
        own(self, "_inner", optimizer)
        own(self, "_world", world)  # the whole mesh: the gradient norm and found-inf are agreed over it
        own(self, "_sharding", sharding)
        own(self, "_loss_factor", loss_factor)  # a pipeline's: checks the factor on a returned loss
        own(self, "_params", optimizer_parameters(optimizer))
        own(self, "_reduced", False)  # this step's gradients are reduced already
        own(self, "_host", host)  # a HostOptimizer (dp_config offload_optimizer) steps instead of the inner one
        mine = {id(p) for p in self._params}
        layout, step_only, size_mb = buckets  # plan_buckets' over the model's parameters: keep the optimizer's
        layout = [kept for kept in ([p for p in bucket if id(p) in mine] for bucket in layout) if kept]
        own(self, "_buckets", GradientBuckets(layout, step_only, sharding or OwnGradients, size_mb))
        self._buckets.overlap = loss_factor is None  # see _apply_pipeline_loss_scale

    def __getattribute__(self, name):
        if name.startswith("__") or name in _OWN_ATTRIBUTES:
            return object.__getattribute__(self, name)
        return getattr(object.__getattribute__(self, "_inner"), name)

    def __setattr__(self, name, value):
        if name in _OWN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)

    def __repr__(self):
        return f"ParallelOptimizer({self._inner!r})"

    @property
    def inner(self):
        return self._inner

    def step(self):
        self._check_scaler_reduced()
        self.reduce_gradients()
        clips = self._clip_groups()
        self._clip_by_global_norm(clips)
        if self._sharding is not None:
            self._sharding.drop_foreign_gradients()
        try:
            for holder, key, _, _ in clips:
                holder[key] = None  # clipped already, with the norm over all shards
            (self._host or self._inner).step()
        finally:
            for holder, key, clip, _ in clips:
                holder[key] = clip
            self._reduced = False
        if self._sharding is not None:
            self._sharding.sync_parameters()

    @property
    def host_optimizer(self):
        """The HostOptimizer holding the state in host memory (dp_config offload_optimizer), or None."""
        return self._host

    def set_state_dict(self, state_dict):
        """Paddle's; under offload_optimizer the loaded state is then moved to host memory."""
        if self._host is not None and any("_fp32_master_" in str(key) for key in state_dict):
            # offloaded masters are named as their parameters: these accumulators' names would never be asked for
            raise ValueError("this optimizer state_dict keys accumulators by Paddle's fp32 master weight names (saved "
                             "without dp_config offload_optimizer); an offloaded optimizer names them by the "
                             "parameters: move state between the two settings with pcp.save_checkpoint and "
                             "pcp.load_checkpoint")
        self._inner.set_state_dict(state_dict)
        if self._host is not None:
            self._host.rehome()

    load_state_dict = set_state_dict

    def clear_grad(self, set_to_zero=True):
        """Also forgets gradients stashed for sharding level 3 and any reduction done for a step
        that was skipped (a GradScaler that found inf)."""
        if self._sharding is not None:
            self._sharding.clear_stash()
        self._buckets.clear(set_to_zero)
        self._reduced = False
        runtime.state.pipeline_loss_scale = None
        self._inner.clear_grad(set_to_zero)

    def reduce_gradients(self):
        """Reduce this step's gradients over the mesh (once; `step()` calls it if nobody did): wait for the
        buckets backward reduced, reduce the others, put the results on the parameters.

        Sums over ranks commute: for each gradient, sums over pipeline stages first (each stage owns its own
        parameters), then at sharding levels 2-3 the reduce-scatter onto owners, so the reductions after it
        only touch the gradients this rank owns."""
        if self._reduced:
            return
        self._apply_pipeline_loss_scale()
        self._buckets.reduce_rest()
        self._buckets.install()
        self._reduced = True

    def keep_gradients_until_step(self):
        """Reduce no bucket during backward from now on: a GradScaler's step reads (and a script may change)
        the gradients backward left, before `reduce_gradients()` (pcp.shard_scaler calls this)."""
        self._buckets.overlap = False

    @property
    def gradient_buckets(self):
        """The buckets (buckets.GradientBuckets): their issue log and gradient bytes, for tests and tools."""
        return self._buckets

    def _apply_pipeline_loss_scale(self):
        """Pipeline: the factor the script put on the losses a scheduled step returned (their backward
        ran unscaled inside the schedule), applied to this rank's gradients before they are reduced;
        first agreed over the mesh (pipeline/loss_factor.py: only dp replicas may differ). Known only after
        the schedule's backwards and possibly different between dp replicas, it must reach the gradients
        before they are summed: a pipeline's buckets are reduced in step()."""
        factor, runtime.state.pipeline_loss_scale = runtime.state.pipeline_loss_scale, None
        if self._loss_factor is not None:
            self._loss_factor.agree(1.0 if factor is None else factor)
        if factor is None:  # a device scalar otherwise: applied without reading it
            return
        for p in self._params:
            if p.grad is not None and p.grad._is_initialized():
                paddle.assign(p.grad * factor, p.grad)
        if self._sharding is not None:
            self._sharding.scale_stash(factor)

    def agree_found_inf(self, found_inf):
        """True on every rank of the mesh when any rank found inf/nan in its gradients (one
        all-reduce of a flag), so every rank skips the step or every rank takes it."""
        flag = paddle.cast(found_inf, "int32").reshape([1])
        collectives.all_reduce(self._world, flag, tag="found_inf_all_reduce")
        return flag > 0

    def _check_scaler_reduced(self):
        """A GradScaler that drives this optimizer (it sets 'found_inf' for this step) unscaled
        gradients before they were reduced: a level-3 rank's stashed gradients stayed scaled and
        each rank decided alone whether to skip. Same check on every rank: all raise together."""
        if isinstance(self._inner._get_auxiliary_var("found_inf"), paddle.Tensor) and not self._reduced:
            raise ValueError("a paddle.amp.GradScaler drives the optimizer parallelize returned: wrap it with "
                             "scaler = pcp.shard_scaler(scaler) (or dist.shard_scaler after pcp.patch_paddle()) "
                             "so gradients are reduced before unscaling and every rank agrees on skipping")

    def _clip_groups(self):
        """(holder, key, clip, params) for every ClipGradByGlobalNorm the inner optimizer would apply.
        Paddle clips each parameter group by its own norm (its `grad_clip`), so do we."""
        inner = self._inner
        groups = inner._param_groups if getattr(inner, "_param_groups", None) and isinstance(
            inner._param_groups[0], dict) else None
        if groups is None:
            pairs = [(_AttrHolder(inner), "_grad_clip", inner._grad_clip, self._params)]
        else:
            pairs = [(group, "grad_clip", group.get("grad_clip"), group["params"]) for group in groups]
        return [pair for pair in pairs if isinstance(pair[2], paddle.nn.ClipGradByGlobalNorm)]

    def _clip_by_global_norm(self, clips):
        if not clips:
            return
        squares = []
        for _, _, _, params in clips:
            counted = [paddle.sum(paddle.square(p.grad.astype("float32"))) for p in params
                       if p.grad is not None and getattr(p, "need_clip", True) and record_of(p).chosen_here()]
            squares.append(paddle.stack(counted).sum() if counted else paddle.zeros([], "float32"))
        totals = collectives.all_reduce(self._world, paddle.stack(squares), tag="grad_norm_all_reduce")
        for (_, _, clip, params), total in zip(clips, paddle.sqrt(totals)):
            max_norm = paddle.full([], clip.clip_norm, "float32")
            scale = max_norm / paddle.maximum(total, max_norm)
            for p in params:
                if p.grad is not None and getattr(p, "need_clip", True):
                    paddle.assign(p.grad * scale.astype(p.grad.dtype), p.grad)

    def minimize(self, loss, startup_program=None, parameters=None, no_grad_set=None):
        """Paddle's dygraph `minimize`: the caller has run `loss.backward()` already; step on its gradients.
        Returns (None, [(param, grad)]) as Paddle does (no ops in dygraph)."""
        if parameters is not None or no_grad_set is not None:
            raise ValueError("minimize(parameters=, no_grad_set=) is not supported by the optimizer parallelize "
                             "returns: give the parameters to the optimizer when you build it (frozen ones with "
                             "stop_gradient=True)")
        self.reduce_gradients()
        params_grads = [(p, p.grad) for p in self._params if p.grad is not None]
        self.step()
        return None, params_grads


_OWN_ATTRIBUTES = frozenset(vars(ParallelOptimizer)) | {
    "_inner", "_world", "_sharding", "_loss_factor", "_params", "_reduced", "_buckets", "_host"}


class _AttrHolder:
    """Lets an optimizer attribute be read and set like a parameter group's dict entry."""

    def __init__(self, obj):
        self._obj = obj

    def __getitem__(self, key):
        return getattr(self._obj, key)

    def __setitem__(self, key, value):
        setattr(self._obj, key, value)
