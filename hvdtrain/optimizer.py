"""The optimizer side: which optimizer, at what learning rate, and how gradients meet across workers.

- The optimizer is the model's own compiled one (its class and settings), a `--optimizer` flag, or Adam.
- Its learning rate is for one worker; the linear scaling rule multiplies it by the number of workers
  (Goyal et al. 2017), reached by a linear warm-up, then a schedule. A compiled schedule counts one
  worker's steps and is scaled alike (SCHEDULE_RULE).
- A model with its own compile and optimizers (keras.io's GAN) has each of them wrapped in place.
- It is wrapped in Horovod's DistributedOptimizer: gradients are averaged by ring-allreduce (or Adasum).
- Every step (TrainStep) also sets the learning rate and checks that the update left the weights finite, inside
  the compiled step: no Python callback and no extra collective per step.
"""
from __future__ import annotations

import math
import typing
import weakref
from dataclasses import dataclass

from . import compat, preemption, runtime, watchdog
from .config import DEFAULT_LR, DEFAULT_OPTIMIZER, Compression, Config, Reduction, UserError


def lr_multiplier(cfg: Config, world: runtime.World) -> float:
    """The linear scaling rule: the global batch grew by workers x passes, so does the learning rate.

    Adasum combines gradients instead of averaging them and wants no such scaling on CPUs (on GPUs,
    with NCCL inside a host, by the local size), as Horovod's Adasum guide says.
    """
    if cfg.reduction == Reduction.ADASUM:
        return float(world.local_size if world.device.startswith("GPU") else 1) * cfg.backward_passes_per_step
    return float(world.size * cfg.backward_passes_per_step)


def _named(name: str, lr: float):
    import tensorflow as tf

    return {
        "sgd": lambda: tf.keras.optimizers.SGD(lr),
        "momentum": lambda: tf.keras.optimizers.SGD(lr, momentum=0.9),
        "adam": lambda: tf.keras.optimizers.Adam(lr),
        "rmsprop": lambda: tf.keras.optimizers.RMSprop(lr),
    }[name]()


def choose(cfg: Config, compiled=None):
    """The optimizer to train with, at the one-worker learning rate: (optimizer, what it is, notes).

    A flag wins over the model's compile (the user typed it for this run) and one note says so.
    """
    import tensorflow as tf

    notes, schedule = [], None
    if compiled is not None and not isinstance(compiled, tf.keras.optimizers.Optimizer):
        compiled = tf.keras.optimizers.get(compiled)  # compile(optimizer="sgd")
    if cfg.optimizer:
        opt, source = _named(cfg.optimizer, cfg.lr or DEFAULT_LR), "--optimizer"
        if compiled is not None:
            notes.append(f"--optimizer {cfg.optimizer} replaces the model's compiled "
                         f"{type(compiled).__name__}")
    elif compiled is not None:
        config = compiled.get_config()
        schedule = compat.lr_schedule(compiled)
        if schedule is not None:
            if cfg.lr is not None:
                raise UserError("--lr: the model's compiled optimizer has a learning-rate schedule; "
                                "leave --lr out or drop the schedule")
            if cfg.lr_schedule != "constant":
                raise UserError(f"--lr-schedule {cfg.lr_schedule}: the model's compiled optimizer has a "
                                f"learning-rate schedule ({type(schedule).__name__}); leave one of them out")
            _set_lr(config, float(schedule(0)))  # a variable, which TrainStep sets from the schedule
        elif cfg.lr is not None:
            notes.append(f"--lr {cfg.lr:g} replaces the compiled learning rate "
                         f"{float(_get_lr(config)):g}")
            _set_lr(config, cfg.lr)
        opt, source = type(compiled).from_config(config), "model.compile"
    else:
        opt, source = _named(DEFAULT_OPTIMIZER, cfg.lr or DEFAULT_LR), "default"
    if cfg.clip_norm:
        if getattr(opt, "clipnorm", None) or getattr(opt, "clipvalue", None):
            notes.append("--clip-norm replaces the optimizer's own clipnorm/clipvalue")
            opt.clipnorm = opt.clipvalue = None
        opt.global_clipnorm = cfg.clip_norm  # applied in apply_gradients: to the averaged gradient
    config = opt.get_config()
    info = {"class": type(opt).__name__, "source": source, "lr": float(_get_lr(config)),
            "schedule": schedule,
            "config": {k: v for k, v in config.items() if isinstance(v, (int, float, bool, str, type(None)))}}
    if schedule is not None:
        notes.append(f"the compiled learning rate is a schedule ({type(schedule).__name__}); {SCHEDULE_RULE}")
    return opt, info, notes


# hvdtrain's one rule for a learning-rate schedule, said at start and in docs/python-api.md
SCHEDULE_RULE = ("it counts one worker's steps (N workers' step is N of them), so it ends where plain Keras' "
                 "does, and is scaled by the workers after the warm-up, as a constant rate is")


def _get_lr(config: dict):
    """The learning rate in an optimizer's config (under a LossScaleOptimizer: its inner one's)."""
    return config["inner_optimizer"]["config"]["learning_rate"] if "inner_optimizer" in config \
        else config["learning_rate"]


def _set_lr(config: dict, lr: float):
    (config["inner_optimizer"]["config"] if "inner_optimizer" in config else config)["learning_rate"] = lr


# the config fields a distributed optimizer is made from
SETTINGS = ("optimizer", "lr", "clip_norm", "compression", "sparse_as_dense", "allreduce_groups", "reduction",
            "backward_passes_per_step", "precision")


@dataclass(frozen=True)
class Made:
    """What hvdtrain made a distributed optimizer from, for the model's next fit()."""
    compiled: object  # the optimizer the model was compiled with (None: hvdtrain chose it)
    settings: tuple  # SETTINGS' values
    info: dict  # choose()'s account of it: class, source, the one-worker lr


_MADE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # not attributes: Keras would track the user's optimizer in checkpoints


def user_class(opt) -> typing.Any:
    """The user's own optimizer class under hvdtrain's and Horovod's wrappers (and a LossScaleOptimizer)."""
    opt = getattr(opt, "inner_optimizer", opt)
    return next(c for c in type(opt).__mro__ if not c.__module__.startswith(("horovod", "hvdtrain")))


def settings(cfg: Config) -> tuple:
    return tuple(getattr(cfg, name) for name in SETTINGS)


def made(opt) -> Made | None:
    """How hvdtrain made `opt` (a model's optimizer after an hvdtrain fit), or None: the user's own."""
    try:
        return _MADE.get(opt)
    except TypeError:  # an optimizer given by name, a string
        return None


def remember(dist, compiled, cfg: Config, info: dict):
    _MADE[dist] = Made(compiled, settings(cfg), info)


def found_in(model) -> dict:
    """The optimizers a model holds in its own attributes, by name: Keras' compiled `optimizer`, and
    those of a model with its own compile (keras.io's GAN keeps `d_optimizer` and `g_optimizer`)."""
    import tensorflow as tf

    return {name: value for name, value in vars(model).items()
            if isinstance(value, tf.keras.optimizers.Optimizer) and not name.startswith("_")}


def distributed(opt, cfg: Config, loss_scale: bool = True):
    """`opt` whose updates average the gradients over the workers first: Horovod's
    DistributedOptimizer on Keras 2 (Adasum keeps `opt`: see TrainStep), on Keras 3 `Distributed`.
    loss_scale: under mixed_float16, Keras 3's optimizer is put in a LossScaleOptimizer, as Keras'
    compile does (False for a step of the user's own, which scales its loss itself or not at all)."""
    if compat.keras3():
        return _distributed_keras3(opt, cfg, loss_scale)
    import horovod.tensorflow as hvd_ops
    import horovod.tensorflow.keras as hvd

    if cfg.reduction == Reduction.ADASUM:
        return opt  # Horovod's Keras optimizer wrapper takes Average or Sum only
    dist = hvd.DistributedOptimizer(
        opt,
        compression=_compression(cfg),
        op=hvd_ops.Average,
        backward_passes_per_step=cfg.backward_passes_per_step,
        average_aggregated_gradients=True,
        sparse_as_dense=cfg.sparse_as_dense,
        num_groups=cfg.allreduce_groups)
    _Keras2Patches(dist)
    compat.serialize_as(type(dist), type(opt))
    return dist


def _distributed_keras3(opt, cfg: Config, loss_scale: bool = True):
    """The Keras 3 distributed optimizer: the user's own optimizer class, whose `apply` first averages
    the gradients over the workers with Horovod's gradient allreduce (the one its Keras 2
    DistributedOptimizer uses: groups, fp16 compression, sparse gradients, Adasum).

    Horovod 0.28.1's Keras layer does not work with Keras 3 (its optimizer wrapper calls Keras 2's
    get_gradients/compute_gradients), while Horovod's TensorFlow ops do. Keras 3's fit, and a custom
    train_step written as keras.io shows, hand the gradients to `optimizer.apply` (apply_gradients
    calls it), so wrapping there averages them whichever step computed them. A subclass of the
    user's class, not patched methods: the optimizer keeps its class's variables, checkpoint names
    and config, and `user_class` names what model.keras is saved with. Under mixed_float16 the
    LossScaleOptimizer is the class wrapped, so the ranks test the averaged gradients for overflow
    and skip the same steps. Accumulating --backward-passes-per-step micro-batches is Keras 3's
    own (gradient_accumulation_steps); each micro-batch's gradients are averaged.
    """
    import horovod.tensorflow as hvd
    import tensorflow as tf

    if loss_scale and tf.keras.mixed_precision.global_policy().name == "mixed_float16" and \
            not isinstance(opt, tf.keras.optimizers.LossScaleOptimizer):
        opt = tf.keras.optimizers.LossScaleOptimizer(opt)
    config = opt.get_config()
    if cfg.backward_passes_per_step > 1:
        target = config["inner_optimizer"]["config"] if "inner_optimizer" in config else config
        target["gradient_accumulation_steps"] = cfg.backward_passes_per_step
    reduce = _signalling(compat.allreduce_gradients_fn(
        hvd.Adasum if cfg.reduction == Reduction.ADASUM else hvd.Average, _compression(cfg), cfg.sparse_as_dense,
        cfg.allreduce_groups))
    base = type(opt)

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        variables = list(trainable_variables if trainable_variables is not None else compat.built_for(self))
        # traced as written: no AutoGraph over Horovod's Python (see _Keras2Patches)
        return base.apply(self, reduce(grads, variables), trainable_variables)

    cls: typing.Any = type(f"Distributed{base.__name__}", (base,), {"apply": apply, "user_class": base,
                                                                     "__module__": __name__})
    compat.serialize_as(cls, base)
    return cls.from_config(config)


def _signalling(allreduce):
    """The gradients' allreduce, as both stacks wrap it: it also carries this rank's preemption flag
    (preemption.py), and counts this rank's arrival there for the hang watchdog (watchdog.py).

    One worker of a job of fixed size has no one to average with, to tell of a stop or to wait for:
    its gradients go to the update as they are, as in plain Keras. Horovod's allreduce would put a
    tf.cond around each gradient and hvdtrain a flag and two counters in the step: at one worker the
    mlp's step took twice plain Keras' time (docs/benchmarks.md, the step's cost). An elastic job
    may grow from one worker, so it keeps them."""
    if alone_for_good():
        return _as_they_are
    return watchdog.arrivals().counting(preemption.flag().along_with(allreduce))


def _as_they_are(grads, variables):
    return list(grads)


def alone_for_good() -> bool:
    """One worker, in a job that cannot grow (not elastic): there is no allreduce to run."""
    return runtime.started() and runtime.world().size == 1 and not runtime.launched_elastic()


class _Keras2Patches:
    """What hvdtrain changes in Horovod 0.28.1's Keras 2 DistributedOptimizer, in one place and order.

    Horovod makes that optimizer's class on the fly, and its methods call `super(self.__class__, self)`:
    a subclass of it would recurse into itself, so (unlike the Keras 3 `Distributed` class above) the
    changes are made to the one instance, here, and this object holds their state:

    1. the gradients' allreduce traced as written. Horovod wraps it in a tf.function with AutoGraph on,
       so every trace of the step converts Horovod's Python, gradient by gradient: 1.2 of the 2.0 s of a
       2-worker cnn's first epoch, 3.5 s of ResNet-50's (measured). That Python branches on Python values
       only (its conditions are tf.cond already), so traced as written it builds the same ops, without
       the cost. It also carries the preemption flag and the watchdog's count (_signalling).
    2. apply_gradients reduces too, when compute_gradients did not in this step. Horovod allreduces in
       compute_gradients, which Keras' own train_step reaches through minimize(); a custom train_step
       that calls apply_gradients itself (the keras.io pattern) would update every rank with its own
       gradients: with TensorFlow 2.15 the ranks' weights silently diverge (measured). `reduced` is
       set while tracing, which is when this Python runs: once per traced step.
    """

    def __init__(self, dist):
        import tensorflow as tf

        self.dist, self.reduced = dist, []
        self.compute, self.apply = dist.compute_gradients, dist.apply_gradients
        reduce = _signalling(compat.horovod_allreduce_grads(dist).python_function)
        compat.set_horovod_allreduce_grads(dist, tf.function(reduce, autograph=False))
        dist.compute_gradients, dist.apply_gradients = self.compute_gradients, self.apply_gradients

    def compute_gradients(self, *args, **kwargs):
        self.reduced.append(True)
        return self.compute(*args, **kwargs)

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        if not self.reduced:
            grads, variables = zip(*list(grads_and_vars))
            grads_and_vars = list(zip(compat.horovod_allreduce(self.dist, grads, variables), variables))
        self.reduced.clear()
        return self.apply(grads_and_vars, *args, **kwargs)


def _compression(cfg: Config):
    import horovod.tensorflow as hvd

    return hvd.Compression.fp16 if cfg.compression == Compression.FP16 else hvd.Compression.none


def check_adasum(model, cfg: Config, world: runtime.World):
    """Refuse what Adasum cannot train, before the first step: the checks of Horovod's Adasum guide."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    if world.size & (world.size - 1):
        raise UserError(f"--reduction adasum needs a power-of-2 number of workers, got {world.size}")
    if world.size > 1 and not hvd.mpi_enabled():
        raise UserError("--reduction adasum needs the MPI controller (horovodrun --mpi, or mpirun)")
    if cfg.backward_passes_per_step > 1 or cfg.precision == "mixed_float16":
        raise UserError("--reduction adasum does not combine with --backward-passes-per-step > 1 "
                        "or --precision mixed_float16")
    if not compat.keras3() and type(model).train_step is not tf.keras.Model.train_step:
        raise UserError("--reduction adasum replaces the model's train_step; this model has its own")


def build(model, opt=None):
    """Create the optimizer's slots now (Keras creates them at the first step), so that a checkpoint
    can be restored into them and they can be broadcast before training starts. opt: the model's
    compiled optimizer when None."""
    opt = model.optimizer if opt is None else opt
    if compat.keras3():  # its LossScaleOptimizer builds its inner optimizer and its own scale
        if not opt.built:
            opt.build(model.trainable_variables)
        return
    getattr(opt, "inner_optimizer", opt).build(model.trainable_variables)  # under a LossScaleOptimizer


def broadcast_initial_state(model, opt=None, root_rank: int = 0):
    """Give every rank rank 0's weights and optimizer slots before the first step.

    Horovod's BroadcastGlobalVariablesCallback broadcasts after the first batch, so that first update
    would start from different weights on each rank; building the optimizer first lets us broadcast
    everything up front, and the first step is already synchronous.
    """
    import horovod.tensorflow as hvd

    opt = model.optimizer if opt is None else opt
    build(model, opt)
    if hvd.size() > 1:
        # Horovod broadcasts the variables one by one, in order: a rank that built its model otherwise
        # (a branch on the rank) would send other shapes, or wait for tensors never sent. Keras 2's
        # broadcast also pairs them by name (a layer built under a rank's name scope hung it); Keras 3
        # numbers layers per process, and its ranks trained with names that differ
        runtime.same_on_every_rank(
            {"the model's variables": [f"{v.dtype.name} {tuple(v.shape)}" + ("" if compat.keras3() else f" {v.name}")
                                       for v in compat.tf_variables(model.variables)]},
            f"{model.name}'s weights, before rank {root_rank} broadcasts them")
        # model.variables also lists lookup tables' handlers (TextVectorization, StringLookup): not
        # variables. Each rank adapted its own table, maybe on data in another order (a vocabulary's
        # ties then fall differently): rank 0's vocabularies go to every rank, so a token has one id.
        lookups = lookup_layers(model)
        if lookups:
            mine = [_vocabulary(l) for l in lookups] if hvd.rank() == root_rank else None
            for layer, vocab in zip(lookups, hvd.broadcast_object(mine, root_rank=root_rank, name="hvdtrain.vocab")):
                layer.set_vocabulary(*vocab)
        hvd.broadcast_variables(compat.tf_variables(model.variables), root_rank=root_rank)
        hvd.broadcast_variables(compat.tf_variables(_variables_of(opt)), root_rank=root_rank)


def _variables_of(opt) -> list:
    """An optimizer's variables: a property on Keras 3, a method on Keras 2's optimizers."""
    return opt.variables() if callable(opt.variables) else opt.variables


def lookup_layers(model) -> list:
    """The layers that hold a vocabulary (StringLookup, TextVectorization; a TextVectorization's own
    StringLookup left out: it follows its owner)."""
    lookups = [l for l in compat.sublayers(model) if hasattr(l, "get_vocabulary") and hasattr(l, "set_vocabulary")]
    inner = {id(getattr(l, "_lookup_layer", None)) for l in lookups}
    return [l for l in lookups if id(l) not in inner]


def copy_vocabularies(source, target):
    """Give `target`'s lookup layers `source`'s vocabularies (Keras 3 keeps them out of get_weights)."""
    for theirs, ours in zip(lookup_layers(source), lookup_layers(target)):
        ours.set_vocabulary(*_vocabulary(theirs))


def _vocabulary(layer) -> tuple:
    """What set_vocabulary takes back: the tokens, and in "tf_idf" mode their IDF weights too (Keras
    refuses the tokens alone there). The weights sit after the special tokens' ([UNK], ...)."""
    tokens = layer.get_vocabulary(include_special_tokens=False)
    lookup = getattr(layer, "_lookup_layer", layer)  # TextVectorization wraps a StringLookup
    if getattr(lookup, "output_mode", None) != "tf_idf":
        return (tokens,)
    specials = len(layer.get_vocabulary()) - len(tokens)
    return tokens, lookup.idf_weights.numpy()[specials:]


class LearningRate:
    """The learning rate at a step, computed in the graph: the one-worker rate (a constant, or the
    compiled schedule at the step one worker would be at: SCHEDULE_RULE), warmed up linearly to
    rate x multiplier over --warmup-epochs, then constant, stepped or cosine-decayed by epoch, times
    what the user's callbacks multiplied it by. What Horovod's LearningRateWarmupCallback and
    LearningRateScheduleCallback do from Python every batch.

    Where the run stands (first epoch, its first step, steps per epoch, workers, the multiplier)
    lives in variables that `start` sets, so a resumed or re-sharded (elastic) run continues the
    same curve.
    """

    def __init__(self, cfg: Config, lr: float, schedule=None):
        import tensorflow as tf

        self.cfg, self.lr, self.schedule = cfg, lr, schedule
        with tf.init_scope():
            self.multiplier = tf.Variable(1.0, dtype=tf.float64, trainable=False)
            self.epoch0 = tf.Variable(0.0, dtype=tf.float64, trainable=False)
            self.step0 = tf.Variable(0, dtype=tf.int64, trainable=False)
            self.steps_per_epoch = tf.Variable(1.0, dtype=tf.float64, trainable=False)
            self.workers = tf.Variable(1.0, dtype=tf.float64, trainable=False)
            # what the user's callbacks multiplied the rate by (callbacks.following_the_learning_rate)
            self.factor = tf.Variable(1.0, dtype=tf.float64, trainable=False)

    def start(self, multiplier: float, epoch: float, step, steps_per_epoch: int, workers: int):
        """Training (re)starts at `epoch` (fractional within an epoch) when the step counter reads
        `step`, with `workers` workers."""
        self.multiplier.assign(multiplier)
        self.epoch0.assign(epoch)
        self.step0.assign(int(step))
        self.steps_per_epoch.assign(steps_per_epoch)
        self.workers.assign(workers)

    def epoch(self, step):
        """Epochs done (fractional) at the step counter `step`."""
        import tensorflow as tf

        return self.epoch0 + tf.cast(step - self.step0, tf.float64) / self.steps_per_epoch

    def one_worker(self, step):
        """The rate of one worker at the step counter `step`: the constant, or the schedule at the
        step one worker would be at (N workers' epoch is N times as many one-worker steps)."""
        import tensorflow as tf

        if self.schedule is None:
            return tf.constant(self.lr, tf.float64)
        steps = tf.round(self.epoch(step) * self.steps_per_epoch * self.workers)
        return tf.cast(self.schedule(tf.cast(steps, tf.int64)), tf.float64)

    def __call__(self, step):
        import tensorflow as tf

        cfg, e = self.cfg, self.epoch(step)
        base = self.one_worker(step)
        peak = base * self.multiplier
        lr = peak
        if cfg.warmup_epochs > 0:
            ramp = base * (1 + (self.multiplier - 1) * tf.minimum(e / cfg.warmup_epochs, 1.0))
            lr = tf.where(e < cfg.warmup_epochs, ramp, peak)
        start = cfg.warmup_epochs
        if cfg.lr_schedule == "cosine":
            span = max(cfg.epochs - start, 1e-9)
            decay = 0.5 * (1 + tf.cos(math.pi * tf.clip_by_value((e - start) / span, 0.0, 1.0)))
            lr = tf.where(e >= start, peak * decay, lr)
        elif cfg.lr_schedule == "step":
            done = tf.floor(e)  # staircase: the epoch the step is in
            passed = tf.add_n([tf.cast(done >= m, tf.float64) for m in cfg.lr_decay_epochs])
            lr = tf.where(done >= start, peak * cfg.lr_decay_factor ** passed, lr)
        return lr * self.factor


NONFINITE = "hvdtrain: the weights are not finite after the update of step"
LABEL_OUT_OF_RANGE = "hvdtrain: a label is outside the classes of the model; label, classes:"
AT_STEP = "before the update of step"


def failed_step(error) -> int | None:
    """The optimizer step a failed train step names (TrainStep's assertions name it), or None."""
    import re

    found = re.search(r"(?:update of step|" + re.escape(AT_STEP) + r")\D*(\d+)", str(error))
    return int(found.group(1)) if found else None


class NonFiniteUpdate(Exception):
    """The weights became NaN or infinite: raised on every rank at the same step."""

    def __init__(self, epoch: int, step: int):
        super().__init__(f"the loss became NaN or infinite at epoch {epoch}, step {step}, on at least one "
                         f"worker; every worker stopped there. Lower --lr, add --clip-norm, or check the "
                         f"data for NaN/Inf")

    @staticmethod
    def step_of(error) -> int | None:
        """The optimizer step a failed train step names, if it is TrainStep's assertion."""
        text = str(error)
        if NONFINITE not in text:
            return None
        import re

        found = re.search(re.escape(NONFINITE) + r"\D*(\d+)", text)
        return int(found.group(1)) if found else -1


class TrainStep:
    """The step hvdtrain's fit() runs, around the model's own train_step, its parts in one order:

    1. the learning rate of each optimizer for this step set, in the graph (`rates`: a LearningRate
       for each: the compiled one's, or every one of a model's own optimizers);
    2. the model's own step, Keras' or the user's. On Keras 2 with --reduction adasum it is Keras'
       step with the gradients reduced by Horovod's DistributedGradientTape: Horovod 0.28.1's Keras
       DistributedOptimizer refuses op=Adasum, its tape does not (on Keras 3 the `Distributed`
       optimizer reduces with Adasum itself);
    3. the weights it produced asserted finite. They are the same on every rank after the allreduce,
       so every rank's assertion fails at the same step and the ranks stop together without a
       collective of their own. (A float16 loss scale skips non-finite steps itself.)

    Keras has no hook around train_step but the model's attribute: `install` sets this object there.
    It keeps the model's own step, so a later fit() puts a new TrainStep around that same step.
    """

    def __init__(self, model, cfg: Config, world: runtime.World, rates: dict, classes: int | None = None,
                 own_counter: bool = False):
        """rates: {the model's attribute holding an optimizer: its LearningRate}. own_counter: the
        steps are counted here, not by the compiled optimizer (a model with optimizers of its own,
        whose compiled one may never step)."""
        import tensorflow as tf

        if cfg.reduction == Reduction.ADASUM:
            check_adasum(model, cfg, world)
        own = model.train_step
        self.model, self.rates, self.cfg, self.classes = model, rates, cfg, classes
        self.own: typing.Callable = own.own if isinstance(own, TrainStep) else own
        self.step = self._adasum if cfg.reduction == Reduction.ADASUM and not compat.keras3() else self.own
        self.counter = None
        if own_counter:
            with tf.init_scope():
                self.counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvdtrain_steps")

    def install(self):
        self.model.train_step = self

    def steps(self):
        """The variable that counts the training steps."""
        return self.counter if self.counter is not None else self.model.optimizer.iterations

    def __call__(self, data):
        import tensorflow as tf

        step = tf.identity(self.steps())  # before this step's update increments it
        for name, rate in self.rates.items():
            opt = getattr(self.model, name)
            opt.learning_rate.assign(tf.cast(rate(step), opt.learning_rate.dtype))
        if self.classes:
            data = self._labels_checked(data)
        with compat.before_apply_gradients(self._refuse_unaveraged):  # Python: runs as the step is traced
            logs = self.step(data)
        total = tf.add_n([tf.reduce_sum(tf.cast(w, tf.float32)) for w in self.model.trainable_variables])
        tf.debugging.Assert(tf.math.is_finite(total), [NONFINITE, step])
        if self.counter is not None:
            self.counter.assign_add(1)
        return logs

    def _refuse_unaveraged(self, opt):
        """Refuse, before its first update, a step that applies gradients through an optimizer that
        does not average them: one the model keeps where hvdtrain cannot find it (a dict, a list, a
        global). Its ranks would train apart. Every rank traces the same step, so every rank stops."""
        for held in found_in(self.model).values():
            chain = [held]  # a LossScaleOptimizer (Keras 2's compile adds one) and the one inside it
            while getattr(chain[-1], "inner_optimizer", None) is not None:
                chain.append(chain[-1].inner_optimizer)
            if any(made(o) is not None for o in chain) and any(o is opt for o in chain):
                return
        held = ", ".join(f"{name} ({user_class(o).__name__})" for name, o in found_in(self.model).items())
        raise compat.past_autograph(UserError(
            f"{self.model.name}'s training step applies gradients through an optimizer "
            f"hvdtrain did not find ({user_class(opt).__name__}), whose updates are not averaged: each worker would train on its own. "
            f"hvdtrain averages those of the optimizers {self.model.name} holds in its attributes "
            f"({held or 'none'}); keep each optimizer in an attribute of the model"))

    def _labels_checked(self, data):
        """The step's data, its labels asserted within the sparse loss's classes before any op reads them:
        a label out of range fails there, as in plain Keras, and not in whichever op of the step (a
        gradient's segment sum, say) happened to meet it first."""
        import tensorflow as tf

        x, y, w = tf.keras.utils.unpack_x_y_sample_weight(data)
        labels = tf.reshape(tf.cast(y, tf.int64), [-1])
        bad = tf.logical_or(labels < 0, labels >= self.classes)
        first = tf.gather(labels, tf.argmax(tf.cast(bad, tf.int32)))
        check = tf.debugging.Assert(tf.logical_not(tf.reduce_any(bad)), [LABEL_OUT_OF_RANGE, first, self.classes,
                                                                        AT_STEP, self.steps()])
        with tf.control_dependencies([check]):
            y = tf.identity(y)
        return tf.keras.utils.pack_x_y_sample_weight(x, y, w)

    def _adasum(self, data):
        """Keras 2's own train_step, its gradients through Horovod's DistributedGradientTape."""
        import horovod.tensorflow as hvd
        import tensorflow as tf

        model, cfg = self.model, self.cfg
        x, y, sample_weight = tf.keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x, y, y_pred, sample_weight)
        tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum, compression=_compression(cfg),
                                           sparse_as_dense=cfg.sparse_as_dense)
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return model.compute_metrics(x, y, y_pred, sample_weight)


def compiled_trains(model) -> bool:
    """Whether the model's compiled optimizer is the one that trains (not a model's own optimizers)."""
    step = model.train_step
    return not isinstance(step, TrainStep) or step.counter is None


def steps(model):
    """The variable that counts a model's training steps under hvdtrain (TrainStep.steps)."""
    step = model.train_step
    return step.steps() if isinstance(step, TrainStep) else model.optimizer.iterations
