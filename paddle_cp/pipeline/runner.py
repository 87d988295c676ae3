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
  the step.
- immediate (no loss known, accumulate_steps 1, one chunk): the forward runs and the
  last stage returns the model's real output. Earlier stages return zeros of the
  same structure and shapes (sent back from the last stage), tied to this stage's
  output: the user's `loss_fn(out, y).backward()` fetches the true gradient from the
  next stage and continues the backward here. Their loss value is meaningless.
"""
from __future__ import annotations

import time

import paddle
from paddle.autograd import PyLayer

from .. import runtime
from ..comm import collectives, stage_p2p
from .microbatch import split_micro_batches
from .schedule import BACKWARD, FORWARD, RECV_B, RECV_F, SEND_B, SEND_F, action_lists


class _StageExit(Exception):
    """Raised after the last unit of a non-final virtual stage: the rest of the forward is another stage's."""

    def __init__(self, output):
        super().__init__("pipeline stage finished")
        self.output = output


_unit_classes = {}


def _unit_class(cls):
    """A subclass of `cls` whose calls go through the pipeline (hooks of skipped units do not run either)."""
    if cls not in _unit_classes:
        def __call__(self, *args, **kwargs):
            return self.__dict__["_pcp_pipeline"].call_unit(self, cls.__call__, args, kwargs)
        _unit_classes[cls] = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})
    return _unit_classes[cls]


def _floats(tensors):
    return [t for t in tensors if t.is_floating_point()]


def _as_leaves(value):
    """Received tensors as leaves that collect their gradient (the one to send back)."""
    for t in _floats(stage_p2p.skeleton(value)[1]):
        t.stop_gradient = False
    return value


class _GradientFromNext(PyLayer):
    """Immediate mode, non-last stage: zeros in the shape of the model's output, whose backward
    receives the gradient of this stage's output from the next stage."""

    @staticmethod
    def forward(ctx, peer, specs, mask, zeros_specs, *outputs):
        ctx.peer, ctx.specs, ctx.mask = peer, specs, mask
        return tuple(stage_p2p.zeros(s) for s in zeros_specs)

    @staticmethod
    def backward(ctx, *unused):
        grads = stage_p2p.recv_tensors(ctx.peer, ctx.specs)
        return tuple(g for g, needed in zip(grads, ctx.mask) if needed)


class _GradientToPrevious(PyLayer):
    """Immediate mode: identity on the received activation; its backward sends the gradient back."""

    @staticmethod
    def forward(ctx, peer, *received):
        ctx.peer = peer
        ctx.shapes = [(t.shape, t.dtype) for t in received]
        return tuple(t.clone() for t in received)

    @staticmethod
    def backward(ctx, *grads):
        grads = [g if g is not None else paddle.zeros(s, d) for g, (s, d) in zip(grads, ctx.shapes)]
        stage_p2p.send_tensors(ctx.peer, grads)
        return tuple(grads)


class _LossAfterBackward(PyLayer):
    """The loss a scheduled step returns: its backward has already run, inside the schedule.
    A plain `loss.backward()` is a no-op; a scaled one would be silently ignored, so it is an error."""

    @staticmethod
    def forward(ctx, anchor, value):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        if not bool(paddle.allclose(grad, paddle.ones_like(grad))):
            raise ValueError("pipeline: model(...) already ran the backward of every micro-batch, so scaling "
                             "its returned loss cannot change the gradients: scale each micro-batch's loss "
                             "in pp_config['loss_fn'] instead (e.g. by pcp.loss_weight)")
        return paddle.zeros([], "float32")


def _tuple(result):
    """PyLayer.apply returns a lone tensor for a single output."""
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def _replace_floats(value, replacements):
    """`value` with its floating tensors replaced, in order."""
    it = iter(replacements)
    skel, tensors = stage_p2p.skeleton(value)
    swapped = iter([next(it) if t.is_floating_point() else t for t in tensors])
    return stage_p2p.fill(skel, lambda spec: next(swapped))


class Pipeline:
    """Runs this rank's stage of `model`; installed by `apply_pipeline`."""

    def __init__(self, model, plan, settings, stage, peers, pp_group):
        self.plan, self.settings, self.stage = plan, settings, stage
        self._peers, self._pp_group = peers, pp_group  # pp position -> stage_p2p Peer
        self._forward = model.forward
        self._unit_stage = {id(layer): v for _, layer, v in plan.units}
        self._exits = {id(plan.exit_unit(v)) for v in range(plan.virtual_stages - 1)}
        self._current = self._received = None
        self._initial = False
        self.timeline = []  # the last scheduled step's actions: (kind, virtual, micro, start, end), wall clock
        self._lists = {}
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
            return self._stand_in(layer)
        if virtual > self._current:
            name = next(n for n, l, _ in self.plan.units if l is layer)
            raise RuntimeError(f"pipeline: layer {name} (virtual stage {virtual}) ran before stage {self._current} "
                               "finished; stages follow registration order, so register layers in the order "
                               "the forward calls them or split with a dict split_spec")
        out = call(layer, *args, **kwargs)
        if id(layer) in self._exits:
            raise _StageExit(out)
        return out

    def _stand_in(self, layer):
        if self._received is None:
            raise RuntimeError("pipeline: a layer of an earlier stage ran but nothing was received from it")
        received, state = self._received
        previous_exit = self.plan.exit_unit(self._current - 1)
        if layer is previous_exit:
            runtime.state.sequence_split = state  # as the skipped layers' hooks would have left it
        if layer is previous_exit or type(layer) is type(previous_exit):
            return received
        return stage_p2p.skeleton(received)[1][0]

    def _run_chunk(self, virtual, args, kwargs, received):
        """One forward of virtual stage `virtual`. `received`: (output, whether the sequence is split over
        mp there) from the stage before. Returns the model's output (last stage) or that pair for the next."""
        self._current, self._received = virtual, received
        runtime.state.sequence_split = self._initial  # as the root's hooks left it, not the previous chunk
        try:
            return self._forward(*args, **kwargs)
        except _StageExit as done:
            return done.output, runtime.state.sequence_split
        finally:
            self._current = self._received = None

    # ---- a step ---------------------------------------------------------------
    def forward(self, *args, **kwargs):
        settings = self.settings
        self._initial = runtime.state.sequence_split
        labels = kwargs.pop("labels", None) if settings.loss_fn is not None else kwargs.get("labels")
        if labels is None:
            if settings.accumulate_steps > 1 or self.plan.chunks > 1:
                raise ValueError(
                    f"pp_config accumulate_steps={settings.accumulate_steps}, vpp_degree={self.plan.chunks} runs a "
                    "schedule, which needs the loss of each micro-batch: call model(..., labels=labels) on a model "
                    "that returns its loss first, or set pp_config['loss_fn'] = fn(output, labels)")
            return self._immediate(args, kwargs)
        return self._scheduled(split_micro_batches(args, kwargs, labels, settings.accumulate_steps))

    def _peer(self, virtual):
        return self._peers[self.plan.rank_of(virtual)]

    def _scheduled(self, micro):
        m, grad = len(micro), paddle.is_grad_enabled()
        key = (m, grad)
        if key not in self._lists:
            self._lists[key] = action_lists(self.settings.schedule_mode, self.plan.stages, m, self.plan.chunks,
                                            backward=grad)[self.stage]
        inputs, outputs, losses, grads_in, grads_out = {}, {}, {}, {}, {}
        self.timeline = []
        for a in self._lists[key]:
            start, at = time.time(), (a.virtual, a.micro)
            if a.kind == RECV_F:
                value = stage_p2p.recv_value(self._peers[a.peer])
                inputs[at] = _as_leaves(value) if grad else value
            elif a.kind == FORWARD:
                args, kwargs, labels = micro[a.micro]
                out = self._run_chunk(a.virtual, args, kwargs, inputs.get(at))
                if a.virtual == self.last:
                    losses[a.micro] = self._loss(out, labels)
                else:
                    outputs[at] = out
            elif a.kind == SEND_F:
                stage_p2p.send_value(self._peers[a.peer], outputs[at] if grad else outputs.pop(at))
            elif a.kind == RECV_B:
                specs = [stage_p2p.spec_of(t) for t in _floats(stage_p2p.skeleton(outputs[at])[1])]
                grads_in[at] = stage_p2p.recv_tensors(self._peers[a.peer], specs)
            elif a.kind == BACKWARD:
                self._backward(at, m, losses, outputs, grads_in)
                if a.virtual > 0:
                    leaves = _floats(stage_p2p.skeleton(inputs.pop(at))[1])
                    grads_out[at] = [t.grad if t.grad is not None else paddle.zeros_like(t) for t in leaves]
            elif a.kind == SEND_B:
                stage_p2p.send_tensors(self._peers[a.peer], grads_out.pop(at))
            self.timeline.append((a.kind, a.virtual, a.micro, start, time.time()))
        return (self._mean_loss(losses, m),)

    def _backward(self, at, m, losses, outputs, grads_in):
        virtual, micro = at
        if virtual == self.last:
            (losses[micro] / m).backward()
            losses[micro] = float(losses[micro])
            return
        pairs = [(t, g) for t, g in zip(_floats(stage_p2p.skeleton(outputs.pop(at))[1]), grads_in.pop(at))
                 if not t.stop_gradient]
        if pairs:
            paddle.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    def _loss(self, out, labels):
        loss = self.settings.loss_fn(out, labels) if self.settings.loss_fn is not None else (
            out if isinstance(out, paddle.Tensor) else out[0])
        if not isinstance(loss, paddle.Tensor) or int(loss.numel()) != 1:
            raise RuntimeError("pipeline: the model's first output is not a scalar loss; pass labels= to a model "
                               "that returns its loss first, or set pp_config['loss_fn'] = fn(output, labels)")
        return loss

    def _mean_loss(self, losses, m):
        """The mean micro-batch loss on every stage; `backward()` on it does nothing (already done)."""
        value = paddle.to_tensor([sum(float(v) for v in losses.values()) / m if losses else 0.0], "float32")
        collectives.broadcast(self._pp_group, value, self.plan.stages - 1, tag="pp_loss_broadcast")
        if not paddle.is_grad_enabled():
            return value.reshape([])
        anchor = paddle.zeros([], "float32")
        anchor.stop_gradient = False
        return _LossAfterBackward.apply(anchor, value.reshape([]))

    def _immediate(self, args, kwargs):
        grad, stage, last_stage = paddle.is_grad_enabled(), self.stage, self.plan.stages - 1
        received = None
        if stage > 0:
            received = stage_p2p.recv_value(self._peers[stage - 1])
            if grad:
                leaves = _floats(stage_p2p.skeleton(_as_leaves(received))[1])
                received = _replace_floats(received, _tuple(_GradientToPrevious.apply(self._peers[stage - 1], *leaves)))
        out = self._run_chunk(stage, args, kwargs, received)
        if stage == last_stage:
            stage_p2p.send_skeleton(self._peers[stage - 1], stage_p2p.skeleton(out)[0])
            return out
        nxt = self._peers[stage + 1]
        stage_p2p.send_value(nxt, out)
        skel = stage_p2p.recv_skeleton(nxt)
        if stage > 0:
            stage_p2p.send_skeleton(self._peers[stage - 1], skel)
        return self._tied_zeros(out, skel, nxt) if grad else stage_p2p.fill(skel, stage_p2p.zeros)

    @staticmethod
    def _tied_zeros(out, skel, nxt):
        """Zeros shaped like the last stage's output; their backward pulls this stage's output gradient."""
        floats = _floats(stage_p2p.skeleton(out)[1])
        needed = [not t.stop_gradient for t in floats]
        wanted = []
        stage_p2p.fill(skel, wanted.append)
        zeros = iter(_tuple(_GradientFromNext.apply(nxt, [stage_p2p.spec_of(t) for t in floats], needed,
                                                    [s for s in wanted if s.is_float],
                                                    *[t for t, n in zip(floats, needed) if n])))
        return stage_p2p.fill(skel, lambda s: next(zeros) if s.is_float else stage_p2p.zeros(s))
