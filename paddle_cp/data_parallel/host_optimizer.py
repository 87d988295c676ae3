"""dp_config `offload_optimizer`: the optimizer state in host memory, each parameter stepped there.

ALST (ZeRO-3 + CPU Adam) and PaddleFormers' `tensorwise_offload_optimizer` keep the optimizer state off the GPU:
AdamW's two fp32 moments and a bf16 model's fp32 master weights are 12 of the 14 bytes per parameter a GPU would
hold. Here every parameter this rank steps (at sharding levels 1-3 only those it owns: the host holds this
rank's share, which is what makes it scale) is stepped on the host by the inner optimizer's own code and CPU
kernels: `_apply_optimize` over one (host parameter, host fp32 gradient) pair, so parameter groups (their
learning rate, weight decay, betas), `apply_decay_param_fun`, regularizers and per-parameter clips
apply as in Paddle's `step`; Adam, AdamW, Momentum and SGD are covered (their CPU kernels take float32; AdamW's
`lr_ratio`, which the CPU kernel applies to the decay alone, is refused).
`ParallelOptimizer.step` clips by the global norm over all shards on the device first, as without offload.

What the host keeps, by the parameter's name N (so checkpoint/layout.py finds it unchanged):
- a float16/bfloat16 parameter under `multi_precision`: its fp32 master weight, registered as
  `inner._master_weights[N]`, named N (not Paddle's `N_fp32_master_*`: `apply_decay_param_fun` is then asked
  about N, as in Paddle's step, which passes it the parameter); the master is authoritative, as Paddle's own is;
- every other parameter: nothing of its own; the device parameter is authoritative (as in Paddle: a script or a
  checkpoint may set it), so each step steps a transient fp32 copy of it;
- the accumulators, created by Paddle's `_create_accumulators` for the host parameter, keyed N
  (`_param_device_map[N] = "cpu"` places them on the CPU), then held in host memory.
Each step, per parameter, one at a time: its gradient cast to fp32 on the device and copied out, the kernel
on the host, the new fp32 value back and cast to the parameter's dtype on the device. The casts run where they
are cheap: Paddle's CPU cast kernels are single-threaded, and casting in and out on the host takes 5 ns an
element (5.7e8 and 3.1e8 elements/s measured on CPU), more than the host AdamW itself (5.6e8/s), while fp32 over
the link costs a bf16 model 4 more bytes an element (0.16 ns at 25 GB/s). The learning rate tensor the kernel reads
is a CPU one during the host step (`_host_learning_rate`).

Where host memory is (the transport, one class per kind of machine):
- `NumpyHost` (CPU, where host and device are one; paddle_cp/host_memory.py): numpy arrays outside Paddle's
  allocator, wrapped as zero-copy Paddle tensors (`paddle.utils.dlpack.from_dlpack`; the kernels write the
  arrays), so the allocator's peak shows what a GPU saves: state created by Paddle in the allocator is moved out
  right after creation.
- `CpuPlaceHost` (GPU): plain CPUPlace tensors (Paddle's CPU allocator is not the GPU's); one D2H copy per
  gradient (and per non-master parameter), one H2D copy per new value (the device holds one parameter's fp32
  value while it is cast), blocking, one parameter at a time (no overlap with compute: the step runs after
  backward). Not run on a GPU: this project's tests have none, and
  the lent GPU machines have no Paddle build (docs/long_sequences.md says what is verified where); on CPU the
  tests run its code (CPU to CPU copies) and count its copies like NumpyHost's.
"""
from __future__ import annotations

import contextlib

import paddle
from paddle.base.framework import _dygraph_place_guard

from ..comm.counters import nbytes
from ..dtypes import LOW_PRECISION
from ..host_memory import NumpyHost
from .optimizer import optimizer_parameters

OFFLOADED_OPTIMIZERS = (paddle.optimizer.Adam, paddle.optimizer.AdamW, paddle.optimizer.Momentum,
                        paddle.optimizer.SGD)


def offload_requested(dp_config):
    """dp_config's `offload_optimizer` (a bool, False when absent)."""
    value = (dp_config or {}).get("offload_optimizer", False)
    if not isinstance(value, bool):
        raise ValueError(f"dp_config offload_optimizer must be True or False, got {value!r}")
    return value


def check_offloadable(optimizer):
    """ValueError naming the fix for an optimizer whose host step paddle_cp does not cover."""
    inner = getattr(optimizer, "inner", optimizer)
    covered = next((cls for cls in type(inner).__mro__ if cls in OFFLOADED_OPTIMIZERS), None)
    if covered is None or type(inner)._append_optimize_op is not covered._append_optimize_op:
        names = ", ".join(cls.__name__ for cls in OFFLOADED_OPTIMIZERS)
        replaced = "" if covered is None else f" (it replaces {covered.__name__}'s update, _append_optimize_op)"
        raise ValueError(f"dp_config offload_optimizer steps {names} on the host with their own CPU kernels, not "
                         f"{type(inner).__name__}{replaced}: use one of those, or set offload_optimizer False")
    if getattr(inner, "_use_multi_tensor", False):
        raise ValueError("dp_config offload_optimizer steps one parameter at a time on the host: build the optimizer "
                         "with use_multi_tensor=False, or set offload_optimizer False")
    if getattr(inner, "_lr_ratio", None) is not None:  # the CPU adamw kernel scales only the decay by it
        raise ValueError("dp_config offload_optimizer steps AdamW with Paddle's CPU kernel, which does not apply "
                         "lr_ratio to the update (Paddle refuses lr_ratio on CPU): drop lr_ratio (give parameter "
                         "groups their own learning rate instead), or set offload_optimizer False")
    low_precision = [p.name for p in optimizer_parameters(inner) if p.dtype in LOW_PRECISION]
    if isinstance(inner, paddle.optimizer.Momentum) and low_precision and not getattr(inner, "_multi_precision", False):
        raise ValueError(f"dp_config offload_optimizer steps an fp32 copy of each parameter on the host, so Momentum's "
                         f"velocity of the float16/bfloat16 parameters {low_precision[:3]} would be fp32 there and "
                         "theirs on a device: build Momentum with multi_precision=True, or set offload_optimizer "
                         "False")


class CpuPlaceHost(NumpyHost):
    """CPUPlace tensors beside a GPU: gradients copied out, new values copied back, one copy each way."""

    def holds(self, tensor):
        return tensor.place.is_cpu_place()

    def hold(self, tensor):
        return tensor._copy_to(paddle.CPUPlace(), True)

    def forget_all_but(self, tensors):
        pass

    def _to_host(self, fp32, keep):
        return fp32._copy_to(paddle.CPUPlace(), True)

    @staticmethod
    def _to_device(host, place):
        return host._copy_to(place, True)


def default_transport():
    return NumpyHost() if paddle.framework._current_expected_place().is_cpu_place() else CpuPlaceHost()


class HostOptimizer:
    """Steps `inner`'s parameters on the host; holds their optimizer state in host memory."""

    def __init__(self, inner, transport=None):
        self.inner = inner
        self.transport = transport or default_transport()

    def groups(self):
        """(parameters, the group's options or None) as Paddle's step reads them now (ParallelOptimizer.step has
        set a group's ClipGradByGlobalNorm aside: it clipped over all shards already)."""
        groups = self.inner._param_groups
        if groups and isinstance(groups[0], dict):
            return [(group["params"], {k: v for k, v in group.items() if k != "params"}) for group in groups]
        return [(self.inner._parameter_list, None)]

    def step(self):
        """Paddle's `step` for the parameters with a gradient, each stepped on the host and written back."""
        inner = self.inner
        found_inf = inner._get_auxiliary_var("found_inf")
        if found_inf:  # a GradScaler found inf/nan: skip the update, as Paddle's step does, which still creates the
            inner._set_auxiliary_var("found_inf", True)  # state (a checkpoint then holds it, zeros as one card's)
            self.create_state([p for p in self._stepped() if p.name not in inner._already_create_accumulator])
            return
        if isinstance(found_inf, paddle.Tensor):
            inner._set_auxiliary_var("found_inf", False)
        stepped = {id(p) for p in self._stepped()}
        with paddle.no_grad(), self.on_host(), _host_learning_rate(inner):
            for index, (params, options) in enumerate(self.groups()):
                for param in params:
                    if id(param) not in stepped:
                        continue
                    target = self._host_parameter(param)
                    grad = self.transport.fp32_copy(param.grad)
                    inner._apply_optimize(loss=None, startup_program=None, param_group_idx=index,
                                          params_grads=_pairs([(target, grad)], options))
                    self.rehome(param.name)  # a first step's new accumulators
                    self.transport.write_back(param, target)

    def _stepped(self):
        """The parameters this step updates: trainable, with a gradient, held here."""
        return [p for params, _ in self.groups() for p in params
                if not p.stop_gradient and p.grad is not None and p._is_initialized()]

    @staticmethod
    def on_host():
        """Tensors made (or filled from numpy: `set_value`) inside are made in host memory."""
        return _dygraph_place_guard(paddle.CPUPlace())

    def create_state(self, params):
        """Create the host state of `params` without stepping (checkpoint restore into a fresh optimizer)."""
        block = paddle.static.default_main_program().global_block()
        wanted = {id(p) for p in params}
        with paddle.no_grad(), self.on_host():
            for params_here, options in self.groups():
                for param in params_here:
                    if id(param) in wanted:
                        self.inner._create_accumulators(block, _pairs([self._host_parameter(param)], options))
                        self.rehome(param.name)

    def _host_parameter(self, param):
        """The fp32 host tensor the kernel steps for `param`: its master weight (kept) or a transient copy."""
        inner = self.inner
        inner._param_device_map[param.name] = "cpu"  # Paddle's _add_accumulator creates them on a CPUPlace
        keeps_master = getattr(inner, "_multi_precision", False) and param.dtype in LOW_PRECISION
        host = inner._master_weights.get(param.name) if keeps_master else None
        if host is None:
            host = self.transport.fp32_copy(param, keep=keeps_master)
            if keeps_master:
                inner._master_weights[param.name] = host
        # also on a master set_state_dict gave (another name, stop_gradient): decay is asked about
        # the parameter's name, and Paddle steps only trainable parameters
        host.name = param.name
        host.stop_gradient = False
        for attr in ("optimize_attr", "regularizer", "need_clip", "do_model_average"):
            if hasattr(param, attr):
                setattr(host, attr, getattr(param, attr))
        return host

    def rehome(self, name=None):
        """Move the accumulators and master weight of the parameter named `name` (of every one when None) to
        host memory where they are not (Paddle creates them in its allocator; `set_state_dict` replaces master
        weights by the tensors it is given)."""
        inner, transport = self.inner, self.transport
        for by_key in [*inner._accumulators.values(), inner._master_weights]:
            for key, tensor in by_key.items():
                if (name is None or key == name) and not transport.holds(tensor):
                    by_key[key] = _named(transport.hold(tensor), tensor)
        if name is None:
            transport.forget_all_but(self.state_tensors())

    def state_tensors(self):
        """Every host tensor of the optimizer state (accumulators, master weights)."""
        inner = self.inner
        return [t for by_param in inner._accumulators.values() for t in by_param.values()] + list(
            inner._master_weights.values())

    def host_bytes(self):
        """Bytes of optimizer state in host memory now."""
        return sum(nbytes(t) for t in self.state_tensors() if self.transport.holds(t))


def _named(host, tensor):
    host.name = tensor.name  # Paddle's state_dict keys accumulators by their names
    return host


def _pairs(pairs, options):
    """What Paddle's step passes `_apply_optimize` / `_create_accumulators`: a list, or a group's dict."""
    return pairs if options is None else {"params": pairs, **options}


@contextlib.contextmanager
def _host_learning_rate(inner):
    """The global learning rate as a CPU tensor while the host steps (the kernel runs where its inputs are;
    Paddle made it on the device, and `set_lr` writes it there)."""
    program = paddle.static.default_main_program()
    rate = inner._learning_rate_map.get(program)
    if rate is None or rate.place.is_cpu_place():
        yield
        return
    inner._learning_rate_map[program] = rate._copy_to(paddle.CPUPlace(), True)
    try:
        yield
    finally:
        inner._learning_rate_map[program] = rate
