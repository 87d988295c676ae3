"""The pipeline at run time: every rank runs the model's own forward code, each unit (see
stages.py) of another stage skipped, and transfers at the stage boundaries.

Inside one forward of virtual stage v: units of earlier stages return the
activation received from stage v-1 instead of computing (the last unit of v-1, and
units of its class, return it as received; others its first tensor, so glue code
such as mask building sees the right shape); units of v compute; after v's last
unit the forward stops (unless v is the last stage) and that unit's output is what
goes to stage v+1. Units in `global_spec` always run.

Two ways to run a step:
- scheduled (a loss is known: the model returns one given `labels=`, or
  pp_config's `loss_fn(output, labels)`): the batch is cut into `accumulate_steps`
  micro-batches and this rank's action list (schedule.py) runs forward and backward
  inside `model(...)`, which returns `(loss,)`: the mean of the micro-batch losses,
  on every stage (sent from the last). Its `backward()` is a no-op: the gradients
  are already accumulated, so the user's `loss.backward(); opt.step()` completes
  the step. With a GradScaler (pcp.shard_scaler), each micro-batch's
  backward starts from its loss times the scaler's scale, as the script's
  `scaler.scale(loss).backward()` would without a pipeline.
- immediate (no loss known, accumulate_steps 1, one chunk): immediate.py.
"""
from __future__ import annotations

import math
import time

import paddle
from paddle.autograd import PyLayer

from .. import runtime
from ..attention.kernels.full_precision import autocast_off
from ..comm import collectives, stage_p2p
from .immediate import run_immediate
from .loss_factor import RELATIVE_TOLERANCE
from .microbatch import split_micro_batches
from .schedule import BACKWARD, FORWARD, RECV_B, RECV_F, SEND_B, SEND_F, action_lists


class _StageExit(BaseException):  # not caught by a model's `except Exception`
    """Raised after the last unit of a non-final virtual stage: the rest of the forward is another stage's."""

    def __init__(self, output):
        super().__init__("pipeline stage finished")
        self.output = output


class _StandIn(BaseException):
    """Raised by a unit of an earlier stage called inside a recompute call: the call returns the stand-in
    as the unit's output (recomputing a layer that does not run here would replay it for real in backward;
    Paddle's reentrant recompute also refuses the received leaf as its output)."""

    def __init__(self, value):
        super().__init__("pipeline stand-in")
        self.value = value


def recompute_boundary(run):
    """Around every recompute call (paddle_cp/activations/recompute.py's `around_calls`): the running
    stage's forward, if any, decides what it returns."""
    pipeline = runtime.state.pipeline_running
    return run() if pipeline is None else pipeline.recompute_call(run)


def _unit_class(cls):
    """A subclass of `cls` whose calls go through the pipeline (hooks of skipped units do not run either)."""
    def make(cls):
        def __call__(self, *args, **kwargs):
            return self.__dict__["_pcp_pipeline"].call_unit(self, cls.__call__, args, kwargs)
        return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return runtime.installed.derived_class("pipeline_unit", cls, make)


def _layout(value):
    """The shapes, dtypes and nesting of a step's micro-batches (hashable): what decides the stage outputs'."""
    if isinstance(value, paddle.Tensor):
        return tuple(value.shape), str(value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(_layout(v) for v in value)
    if isinstance(value, dict):
        return tuple((key, _layout(v)) for key, v in sorted(value.items()))
    return repr(value)


class _LossAfterBackward(PyLayer):
    """The loss a scheduled step returns: its backward has already run, inside the schedule, with a
    unit loss gradient. A scaled `loss.backward()` (a script's `(loss / k).backward()` accumulating k
    calls, a GradScaler's `scale(loss)`) records its factor, which the optimizer applies to the
    accumulated gradients at its step (runtime.state.pipeline_loss_scale, a device scalar: nothing is
    read here), less the scale the schedule applied already (`applied`: a GradScaler's, so its factor is
    1); the calls of one step must agree on it, since their gradients are already summed: compared
    on the device, the answer agreed at the optimizer step (pipeline/loss_factor.py)."""

    @staticmethod
    def forward(ctx, anchor, value, applied):
        ctx.applied = applied
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        state, factor = runtime.state, grad.reshape([])
        if ctx.applied is not None:
            factor = factor / ctx.applied.reshape([])
        pending = state.pipeline_loss_scale
        if pending is None:  # the step's first call
            state.pipeline_loss_scale, state.pipeline_loss_scales_differ = factor, None
        else:
            differ = (factor - pending).abs() > RELATIVE_TOLERANCE * paddle.maximum(factor.abs(), pending.abs())
            earlier = state.pipeline_loss_scales_differ
            state.pipeline_loss_scales_differ = differ if earlier is None else paddle.logical_or(earlier, differ)
        return paddle.zeros([], "float32")


class Pipeline:
    """Runs this rank's stage of `model`; installed by `apply_pipeline`."""

    def __init__(self, model, plan, settings, stage, peers, pp_group):
        self.plan, self.settings, self.stage = plan, settings, stage
        self.peers, self._pp_group = peers, pp_group  # pp position -> mesh.Peer
        self._forward = model.forward
        self._unit_stage = {id(layer): v for _, layer, v in plan.units}
        self._exits = {id(plan.exit_unit(v)) for v in range(plan.virtual_stages - 1)}
        self._current = self._received = None
        self._recomputing, self._exit_pending = 0, False  # recompute calls open in this forward; its exit unit ran
        self._initial = (False, None)  # sequence_split, sequence_whole_shape
        self.timeline = []  # the last scheduled step's actions: (kind, virtual, micro, start, end), wall clock
        self._lists = {}
        # (the batch layout of the last scheduled step, {(direction, virtual, micro): skeleton}): the
        # activations' skeletons cross a stage boundary once per batch layout, not every micro-batch
        self._skeletons = (None, {})
        for _, layer, _ in plan.units:
            layer._pcp_pipeline = self
            layer.__class__ = _unit_class(type(layer))
        model.forward = self.forward
        model._pcp_pipeline = self  # for step_timeline(model)

    @property
    def last(self):
        return self.plan.virtual_stages - 1

    # ---- inside one forward --------------------------------------------------
    def call_unit(self, layer, call, args, kwargs):
        virtual = self._unit_stage[id(layer)]
        if self._current is None or virtual is None:
            return call(layer, *args, **kwargs)
        if virtual < self._current:
            if self._recomputing:
                raise _StandIn(self._stand_in(layer))
            return self._stand_in(layer)
        if virtual > self._current:
            name = next(n for n, l, _ in self.plan.units if l is layer)
            if self._exit_pending:  # on the later stage this call would be cut at the boundary: refuse it here
                raise RuntimeError(f"pipeline: one recompute call runs the last layer of stage {self._current} and "
                                   f"{name} of the next stage; recompute calls must end at a stage boundary "
                                   "(recompute one layer per call, as PaddleFormers' full recompute does, or "
                                   "split the stages where the calls end)")
            raise RuntimeError(f"pipeline: layer {name} (virtual stage {virtual}) ran before stage {self._current} "
                               "finished; stages follow registration order, so register layers in the order "
                               "the forward calls them or split with a dict split_spec")
        out = call(layer, *args, **kwargs)
        if id(layer) in self._exits:
            if self._recomputing:  # computed without its graph (reentrant): leave with the call's output
                self._exit_pending = True
                return out
            raise _StageExit(out)
        return out

    def recompute_call(self, run):
        """A recompute call in this stage's forward: one around a unit of an earlier stage returns its stand-in
        (the function returns the unit's output, as PaddleFormers' calls do); one around this stage's last
        unit ends the stage with the call's output."""
        self._recomputing += 1
        try:
            out = run()
        except _StandIn as stand_in:
            return stand_in.value
        finally:
            self._recomputing -= 1
        if self._exit_pending and not self._recomputing:
            raise _StageExit(out)
        return out

    def _stand_in(self, layer):
        if self._received is None:
            raise RuntimeError("pipeline: a layer of an earlier stage ran but nothing was received from it")
        received, split, whole_shape = self._received
        previous_exit = self.plan.exit_unit(self._current - 1)
        if layer is previous_exit:
            # as the skipped layers' hooks would have left it
            runtime.state.sequence_split, runtime.state.sequence_whole_shape = split, whole_shape
        if layer is previous_exit or type(layer) is type(previous_exit):
            return received
        first = stage_p2p.skeleton(received)[1][0]
        if whole_shape is not None:  # the sequence was split at the first block: earlier layers gave it whole
            return paddle.zeros(list(whole_shape), first.dtype)
        return first

    def run_chunk(self, virtual, args, kwargs, received, micro=(0, 1)):
        """One forward of virtual stage `virtual`. `received`: (output, whether the sequence is split over
        mp there, the whole shape it had before: see plans/sequence_parallel.py) from the stage before;
        `micro`: (index, count) of its micro-batch. Returns the model's output (last stage) or that triple
        for the next."""
        self._current, self._received, self._exit_pending = virtual, received, False
        runtime.state.pipeline_running = self
        # as the root's hooks left it, not the previous chunk
        runtime.state.sequence_split, runtime.state.sequence_whole_shape = self._initial
        batches = runtime.state.batches.running
        depth = len(batches)
        if micro[1] > 1 and batches:  # the whole batch's facts (documents, padding) as this micro-batch's rows
            batches.append(batches[-1].micro_batch(*micro))
        try:
            return self._forward(*args, **kwargs)
        except _StageExit as done:
            return done.output, runtime.state.sequence_split, runtime.state.sequence_whole_shape
        finally:
            self._current = self._received = runtime.state.pipeline_running = None
            # a stage's exit is no Exception, so the top layer's post-hooks skip it: its batch is forgotten here
            del batches[depth:]

    # ---- a step ---------------------------------------------------------------
    def forward(self, *args, **kwargs):
        settings = self.settings
        self._initial = runtime.state.sequence_split, runtime.state.sequence_whole_shape
        labels = kwargs.pop("labels", None) if settings.loss_fn is not None else kwargs.get("labels")
        if labels is None:
            if settings.accumulate_steps > 1 or self.plan.chunks > 1:
                raise ValueError(
                    f"pp_config accumulate_steps={settings.accumulate_steps}, vpp_degree={self.plan.chunks} runs a "
                    "schedule, which needs the loss of each micro-batch: call model(..., labels=labels) on a model "
                    "that returns its loss first, or set pp_config['loss_fn'] = fn(output, labels)")
            return run_immediate(self, args, kwargs)
        return self._scheduled(split_micro_batches(args, kwargs, labels, settings.accumulate_steps))

    def _scheduled(self, micro):
        m, grad = len(micro), paddle.is_grad_enabled()
        key = (m, grad)
        if key not in self._lists:
            self._lists[key] = action_lists(self.settings.schedule_mode, self.plan.stages, m, self.plan.chunks,
                                            backward=grad)[self.stage]
        inputs, outputs, losses, grads_in, grads_out = {}, {}, {}, {}, {}
        scale = self._loss_scale() if grad else None
        self.timeline = []
        layout = (grad, _layout(micro))
        if self._skeletons[0] != layout:
            self._skeletons = (layout, {})
        known = self._skeletons[1]
        for a in self._lists[key]:
            start, at = time.time(), (a.virtual, a.micro)
            if a.kind == RECV_F:
                inputs[at] = stage_p2p.recv_value(self.peers[a.peer], grad, known.get(("recv", at)))
                known.setdefault(("recv", at), stage_p2p.skeleton(inputs[at])[0])
            elif a.kind == FORWARD:
                args, kwargs, labels = micro[a.micro]
                out = self.run_chunk(a.virtual, args, kwargs, inputs.get(at), (a.micro, m))
                if a.virtual == self.last:
                    losses[a.micro] = self._loss(out, labels)
                else:
                    outputs[at] = out
            elif a.kind == SEND_F:
                value = outputs[at] if grad else outputs.pop(at)
                stage_p2p.send_value(self.peers[a.peer], value, announce=self._announce(known, at, value))
            elif a.kind == RECV_B:
                specs = [stage_p2p.spec_of(t) for t in stage_p2p.float_tensors(outputs[at])]
                grads_in[at] = stage_p2p.recv_tensors(self.peers[a.peer], specs)
            elif a.kind == BACKWARD:
                # as without a pipeline, backward runs outside autocast; entering auto_cast also re-arms Paddle's
                # master-gradient hook, which casts the gradients to fp32 once per backward (every micro-batch's)
                with autocast_off():
                    self._backward(at, m, losses, outputs, grads_in, scale)
                if a.virtual > 0:
                    leaves = stage_p2p.float_tensors(inputs.pop(at))
                    grads_out[at] = [t.grad if t.grad is not None else paddle.zeros_like(t) for t in leaves]
            elif a.kind == SEND_B:
                stage_p2p.send_tensors(self.peers[a.peer], grads_out.pop(at))
            self.timeline.append((a.kind, a.virtual, a.micro, start, time.time()))
        return (self._mean_loss(losses, m, scale),)

    @staticmethod
    def _announce(known, at, value):
        """Whether the skeleton of `value` must be sent: the first time for this batch layout. The same layout
        gives the same skeletons (shapes follow the batch's), which the receiver then assumes."""
        skel = stage_p2p.skeleton(value)[0]
        sent = known.setdefault(("send", at), skel)
        if sent is skel:
            return True
        if sent != skel:
            raise RuntimeError(f"pipeline: the output of virtual stage {at[0]} for micro-batch {at[1]} changed its "
                               "shapes although the batch's did not; stage outputs must follow the batch's shapes")
        return False

    @staticmethod
    def _loss_scale():
        """The GradScaler's scale (a device tensor) when one is on, else None: read at each step's start, the
        scale the script's `scaler.scale(loss)` applies after it (the scaler changes it at its step only)."""
        scaler = runtime.state.grad_scaler and runtime.state.grad_scaler()
        return scaler._scale if scaler is not None and scaler._enable else None

    def _backward(self, at, m, losses, outputs, grads_in, scale):
        virtual, micro = at
        if virtual == self.last:
            (losses[micro] / m if scale is None else losses[micro] * (scale.reshape([]) / m)).backward()
            losses[micro] = losses[micro].detach()  # its graph is spent; no host sync per micro-batch
            return
        pairs = [(t, g) for t, g in zip(stage_p2p.float_tensors(outputs.pop(at)), grads_in.pop(at))
                 if not t.stop_gradient]
        if pairs:
            paddle.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    def _loss(self, out, labels):
        loss = self.settings.loss_fn(out, labels) if self.settings.loss_fn is not None else (
            out if isinstance(out, paddle.Tensor) else out[0])
        if not isinstance(loss, paddle.Tensor) or math.prod(loss.shape) != 1:
            raise RuntimeError("pipeline: the model's first output is not a scalar loss; pass labels= to a model "
                               "that returns its loss first, or set pp_config['loss_fn'] = fn(output, labels)")
        return loss

    def _mean_loss(self, losses, m, scale):
        """The mean micro-batch loss on every stage; `backward()` on it does nothing (already done)."""
        if losses:  # the last stage: one device-side sum of the micro-batch losses
            value = paddle.add_n([v.detach().astype("float32").reshape([1]) for v in losses.values()]) / m
        else:
            value = paddle.zeros([1], "float32")
        collectives.broadcast(self._pp_group, value, self.plan.stages - 1, tag="pp_loss_broadcast")
        if not paddle.is_grad_enabled():
            return value.reshape([])
        anchor = paddle.zeros([], "float32")
        anchor.stop_gradient = False
        return _LossAfterBackward.apply(anchor, value.reshape([]), scale)
