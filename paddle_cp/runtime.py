"""Everything paddle_cp keeps per process, and the one `reset()` that clears it.

`state` (RuntimeState): what hooks and collectives record while models run (the batch running, counters,
the collectives in flight, pending deferred facts, the replays running, the host copies of offloaded
recompute inputs, the user hooks a plan's check resolved for its apply). `installed` (Installed): what
paddle_cp puts into the process for the models parallelized in it: process groups, the modules each
ContextParallel covers and the layers each token mixer is attached to, the sequence-parallel Begin layers that
split at the blocks, token mixers and the attention classes model libraries register, MoE block kinds, fused-weight rules, recompute
carriers and the wrapping of Paddle's recompute, the flash kernels' seed tensor, classes derived from the
models' layer classes, patches of Paddle's and PaddleFormers' functions, the collective timeout and its watchdog thread, the signal handlers a resumable run replaced. A run's own state (a plan applied to one model: its groups, batch check, positions) lives in
the hooks `parallelize` registered on that model, not here and not on the plan objects.

`reset()` (a test, or a new training run in the same process) forgets every record and derived class.
It keeps what it cannot or need not remake: process groups, ParallelDims and the count of group rendezvous (made
collectively, by every rank in one order; Paddle cannot destroy a gloo group without its peers, and a later parallelize of the same ranks
reuses them); the layers mixers are attached to and the Begin layers that split at the blocks (weak); mixers,
attention classes, block kinds, fused-weight rules, recompute carriers and Paddle's wrapped recompute (registered once, at import or by the user), the flash kernels' seed tensor (a constant); the plans of modules (weak: they go with their models); patches (held by live models, undone
when the last is released, or by unpatch_paddle); the timeout set_timeout gave and the watchdog thread; the signal handlers a running resumable run replaced (it restores them when it ends). An async checkpoint save still writing makes it raise (wait_checkpoint() first).
"""
from __future__ import annotations

import itertools
import weakref
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class BatchRecords:
    """The batches of attention/dispatch/batch.py, by who reads them."""

    running: list = field(default_factory=list)  # Batch of each top layer whose forward runs (innermost last)
    # sep group ranks -> the Batches shard_sequence split tensors in since the group's last forward (labels)
    sharded: dict = field(default_factory=dict)
    last: dict = field(default_factory=dict)  # sep group ranks -> the Batch the last forward over them split
    # the Batch of each vision-language model whose forward runs before its language model split it (innermost last)
    merging: list = field(default_factory=list)


@dataclass
class RuntimeState:
    sequence_split: bool = False  # is the sequence split over mp at this point of the forward?
    # SequenceParallelBegin's split, waiting for the first block of the region (plans/sequence_parallel.py)
    pending_split: object = None
    # the whole [b, s, h] shape the region's first block was given before that split: what the model's code
    # between the Begin layer and the blocks saw (a later pipeline stage's stand-ins give it that shape)
    sequence_whole_shape: tuple | None = None
    bytes_sent: defaultdict = field(default_factory=lambda: defaultdict(int))  # bytes this rank sent, by tag
    collectives_issued: defaultdict = field(default_factory=lambda: defaultdict(int))  # collectives, by tag
    emulating_collective: bool = False  # gloo's point-to-point rounds of one collective are running
    widened_float16: defaultdict = field(default_factory=lambda: defaultdict(int))  # gloo fp16 all-reduces, by tag
    # the Batches PrepareContextParallel and shard_sequence made (attention/dispatch/batch.py)
    batches: BatchRecords = field(default_factory=BatchRecords)
    # routing.Frame of each ContextParallel layer whose forward is running (innermost last)
    running: list = field(default_factory=list)
    # query-key pairs computed and skipped by attention forwards
    attention_work: dict = field(default_factory=lambda: {"computed": 0, "skipped": 0})
    # one memo per running recompute call: the sep groups whose batch PrepareContextParallel has checked
    # in it, so a replay in backward does not gather again (plans/same_batch.py)
    checked_batches: list = field(default_factory=list)
    # check_parity's reference forward: PrepareContextParallel splits nothing and ContextParallel routes
    # nothing (every rank computes the whole sequence with the model's own attention)
    context_parallel_paused: bool = False
    # pipeline: the factor the script applied to the losses scheduled steps returned since the last
    # optimizer step (`(loss / k).backward()`, a GradScaler's scale); the optimizer applies it
    pipeline_loss_scale: object = None  # a device scalar (the loss gradient), or None
    # pipeline: True (a bool device scalar) once two calls of this step scaled their losses differently
    pipeline_loss_scales_differ: object = None
    # a weak reference to the GradScaler pcp.shard_scaler made safe last: a pipeline's schedule scales every
    # micro-batch's loss by its scale before that backward (data_parallel/scaler.py)
    grad_scaler: object = None
    # pipeline: the Pipeline (pipeline/runner.py) whose stage forward is running: recompute calls ask it
    pipeline_running: object = None
    pending_save: object = None  # the async checkpoint save whose files are still being written
    # a library's weight loading casts each file tensor to its parameter's dtype (pcp-train's O2: its integration)
    casting_to_model_dtypes: bool = False
    # recovery/signals.py: the last preemption signal (SIGTERM, SIGUSR1) this rank received, 0 if none; agreed over
    # the ranks at the next step boundary
    preemption_signal: int = 0
    # bytes this process read from and wrote to checkpoint and pretrained-weight files (checkpoint/io_bytes.py)
    io_bytes: dict = field(default_factory=lambda: {"read": 0, "written": 0})
    # comm/watchdog.py: token -> (started, op, (group ranks, peers or None), completion event or None) of each
    # collective in flight
    collectives_in_flight: dict = field(default_factory=dict)
    # activations/replay.py: how many replays in backward (a recompute call's, a sequence tile's) are running
    replay_depth: int = 0
    # activations/replay.py: bytes the innermost running replay's forwards keep for its backward (hold_briefly)
    replay_held: int = 0
    # activations/host_offload.py: OffloadRecomputeInputs plan -> the HostCheckpoints its layers share
    host_checkpoints: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    # plans/layer_hooks.py: layer -> {user-hook plan: (mesh, the hook its factory returned)}, from the plan's
    # check until its apply registers the hook (the factory is called once)
    resolved_hooks: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)


state = RuntimeState()


class Installed:
    """What paddle_cp installs in the process (see the module's doc for what reset keeps)."""

    def __init__(self):
        self.groups = {}  # mesh slice key -> this rank's MeshGroup (mesh.py)
        self.process_groups = {}  # sorted ranks -> Paddle's group over them, made once (mesh.py)
        self.parallel_dims = {}  # (ranks, shape, dim names) -> the mesh's ParallelDims, its named groups (mesh.py)
        self.group_rendezvous = 0  # new_group rendezvous so far, the same count on every rank: each gloo group's store key (mesh.py)
        self.started_communicators = set()  # sorted ranks of the groups whose NCCL communicator p2p.shift started
        self.planned = weakref.WeakKeyDictionary()  # module -> the SepRun of the ContextParallel covering it
        # attention/mixers/base.py: layer -> {token mixer: the SepRun it was attached under}
        self.mixer_runs = weakref.WeakKeyDictionary()
        # plans/sequence_parallel.py: the SequenceParallelBegin layers whose split waits for the region's blocks
        self.split_at_blocks = weakref.WeakKeyDictionary()
        self.mixers = []  # TokenMixer instances, looked up in order (attention/mixers/registry.py)
        self.recompute_captures = []  # activations/recompute.py: state a recompute replay needs again
        self.recompute_wrappers = []  # activations/recompute.py: around every whole recompute call
        self.recompute_saving_wrappers = []  # activations/recompute.py: told each call's function and inputs
        self.recompute_wrapped = False  # activations/recompute.py: Paddle's recompute entry points are wrapped
        self.attention_classes = []  # attention/mixers/softmax.py: predicates on a layer's class, by model libraries
        self.no_dropout_seed = None  # attention/kernels/flash.py: the int64 [2] (0, 0) seed tensor, made on first use
        self.derived_classes = {}  # (purpose, layer class) -> its subclass (experts, pipeline units)
        self._patches = {}  # name -> (ids of the live holders, undo)
        self.paddle_patches = []  # api/paddle_compat.py: (module, name, Paddle's function) of each attribute replaced
        self.sdpa_original = None  # attention/adapters/sdpa.py: Paddle's SDPA while the routed one replaces it
        self.fused_weight_rules = []  # api/plan_annotation.py: factories model -> parts, registered by model libraries
        self.block_kinds = []  # experts/blocks.py: BlockKind, in registration order
        self.vision_language = []  # plans/vision_language.py: VisionLanguage rules, registered by model libraries
        self.loss_layers = []  # sequence/empty_share.py: LossLayer kinds, registered by model libraries
        self.guarded_losses = weakref.WeakKeyDictionary()  # sequence/empty_share.py: loss layer -> its hooks
        self.vision_splits = weakref.WeakKeyDictionary()  # plans/vision_split.py: vision tower -> its VisionSplitRun
        self.recompute_settings = []  # activations/recompute_settings.py: rules registered by model libraries
        self.weight_formats = []  # checkpoint/weight_formats.py: WeightFormat, registered by model libraries
        self.attention_adapters = {}  # attention/adapters: name -> (install, uninstall), registered by model libraries
        self.collective_timeout = None  # comm/watchdog.py: seconds set by set_timeout, else None
        self.watchdog = None  # comm/watchdog.py: its thread, once started
        self.collective_tokens = itertools.count()  # comm/watchdog.py: keys of the collectives in flight
        # recovery/signals.py: signal number -> the handler it had before a resumable run noted preemptions
        self.preemption_handlers = {}

    def derived_class(self, purpose, cls, make):
        """The subclass `make(cls)` for `purpose`, made once per class."""
        key = (purpose, cls)
        if key not in self.derived_classes:
            self.derived_classes[key] = make(cls)
        return self.derived_classes[key]

    def hold_patch(self, name, holder, install, undo):
        """Patch `name` stays installed while `holder` (a parallelized layer) lives: `install()` (idempotent,
        called for every holder: it may find more to patch), `undo()` once the last holder has been released
        (garbage-collected)."""
        install()
        if name not in self._patches:
            self._patches[name] = (set(), undo)
        holders = self._patches[name][0]
        if id(holder) not in holders:
            holders.add(id(holder))
            weakref.finalize(holder, self._release, name, id(holder))

    def patched(self, name):
        return name in self._patches

    def _release(self, name, holder_id):
        holders, undo = self._patches.get(name, (set(), None))
        holders.discard(holder_id)
        if undo is not None and not holders:
            del self._patches[name]
            undo()


installed = Installed()


def reset():
    """Forget every record and derived class (in place: modules keep their reference to `state`)."""
    if state.pending_save is not None:
        raise RuntimeError("an async checkpoint save is still being written: call paddle_cp.wait_checkpoint() "
                           "on every rank before reset()")
    state.__dict__.update(RuntimeState().__dict__)
    installed.derived_classes.clear()
