"""Step 5 of the recipe: the model compiled as its user compiled it (or as the flags say), with the
learning rate scaled and the optimizer wrapped in Horovod's DistributedOptimizer (optimizer.py); the
config resolved once, with the batch size and learning rate the job trains with."""
from __future__ import annotations

import dataclasses

from . import callbacks as callbacks_lib
from . import compat, models, optimizer, runtime
from .config import Config, UserError
from .runtime import log


@dataclasses.dataclass(frozen=True)
class Trainer:
    """What compile_for_training decided: for the fit loop, the summary and the log."""
    learning_rate: optimizer.LearningRate | None  # the compiled optimizer's (None: optimizers of the model's own)
    optimizer: dict
    loss: str
    steps_per_execution: int
    notes: list
    callbacks: list  # the user's, those this rank runs
    per_batch: list  # the names of the user's callbacks that act per batch, on any rank
    rates: dict  # every optimizer's LearningRate, by the model's attribute that holds it

    def peak_lr(self, cfg: Config, world) -> float | None:
        lr = self.optimizer["lr"]
        return None if lr is None else lr * optimizer.lr_multiplier(cfg, world)


def compile_for_training(model, cfg: Config, world: runtime.World, data, callbacks: list):
    """Compile `model` as its user did (or as the flags say), with the optimizer scaled and wrapped.
    Returns (the config resolved: the batch size of the data, the one-worker lr it trains with;
    Trainer). Callbacks that act per batch make Keras call them every step, as plain Keras does (1
    step per call): `callbacks` are all of the user's, those rank 0 alone will run included, so that
    every rank decides alike; what shapes the traced step is then checked to be the same on every
    rank (runtime.same_on_every_rank)."""
    cfg = dataclasses.replace(cfg, batch_size=data.batch_size)
    per_batch = callbacks_lib.acting_per_batch(callbacks)
    # one stream across epochs (an infinite pipeline) has no epoch's end for a call to stop at
    plan = models.compile_plan(model, cfg, data.steps_per_epoch if data.epoch is None else None, bool(per_batch))
    _xla_only_where_horovod_has_it(plan, cfg, world)
    if optimizer.alone_for_good():
        plan.notes.append("one worker: its gradients go to the update as they are, with no allreduce")
    own = own_compile(model)
    if own:
        info, rates, notes = _keep_own_compile(model, cfg, plan, own)
    else:
        info, rates, notes = _compile_with_distributed_optimizer(model, cfg, plan)
    cfg = dataclasses.replace(cfg, lr=info["lr"] if info["lr"] is not None else cfg.lr)
    _refuse_data_without_targets(model, data.element_spec)
    _build_model(model, data.element_spec)
    optimizer.TrainStep(model, cfg, world, rates, None if own else _sparse_classes(
        model, plan.kwargs["loss"], data.element_spec), own_counter=bool(own)).install()
    log.info("%s: loss %s; %s from %s, lr %s for one worker; %d step(s) per call", model.name, plan.loss,
             info["class"], info["source"], "a schedule" if info["schedule"] else
             "each its own" if info["lr"] is None else f"{info['lr']:g}",
             plan.steps_per_execution)
    _build_loss_and_metrics(model, data.element_spec)
    runtime.same_on_every_rank(_decisions(model, cfg, data, plan, per_batch), f"{model.name}'s training step")
    return cfg, Trainer(rates.get("optimizer"), info, plan.loss, plan.steps_per_execution, plan.notes + notes,
                        callbacks_lib.for_this_rank(callbacks, world.is_chief), per_batch, rates)


def _compile_with_distributed_optimizer(model, cfg: Config, plan):
    """Keras' own compile, called again with the optimizer chosen, scaled and wrapped: (what the
    optimizer is, {"optimizer": its LearningRate}, notes)."""
    again = optimizer.made(plan.optimizer)  # fit() again, not compiled since: Keras' optimizer goes on
    if again is not None and again.settings == optimizer.settings(cfg):
        dist, info, notes = plan.optimizer, again.info, []
    else:
        compiled = again.compiled if again is not None else plan.optimizer
        opt, info, notes = optimizer.choose(cfg, compiled)
        if again is not None:
            notes.append("this fit() changes the optimizer's settings: its state (slots, step) starts afresh")
        dist = optimizer.distributed(opt, cfg)
        optimizer.remember(dist, compiled, cfg, info)
    model.compile(optimizer=dist, **plan.kwargs)
    _calls_as_planned(model, plan)
    return info, {"optimizer": optimizer.LearningRate(cfg, info["lr"], info["schedule"])}, notes


def _calls_as_planned(model, plan):
    model.autotune_steps_per_execution = False  # Keras' compile leaves a user's "auto" tuner on
    model.steps_per_execution = plan.steps_per_execution  # the compile config keeps the user's own


def own_compile(model) -> dict:
    """The optimizers of a model that keeps its compile as written: {attribute: optimizer}, or {}
    for a model compiled with Keras' compile(optimizer=...) and one optimizer. A compile of its own
    that takes no `optimizer` (keras.io's GAN: compile(d_optimizer, g_optimizer, loss_fn)), or
    optimizers beside the compiled one, cannot be compiled again with one distributed optimizer."""
    import inspect

    found = optimizer.found_in(model)
    params = inspect.signature(model.compile).parameters
    takes_optimizer = "optimizer" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    return found if not takes_optimizer or set(found) - {"optimizer"} else {}


FLAGS_OF_COMPILE = ("optimizer", "lr", "loss", "metrics", "clip_norm")


def _keep_own_compile(model, cfg: Config, plan, found: dict):
    """A model with its own compile or several optimizers trains as compiled: every optimizer it
    holds is replaced by its distributed copy (the same class and settings, its updates averaged),
    each at the learning rate's rule. A step that applies gradients through an optimizer held
    elsewhere would train each rank on its own: TrainStep refuses it as the step is traced."""
    names = ", ".join(found)
    flags = [f"--{k.replace('_', '-')}" for k in FLAGS_OF_COMPILE if getattr(cfg, k)]
    if cfg.backward_passes_per_step > 1:
        flags.append("--backward-passes-per-step")
    if flags:
        raise UserError(f"{' '.join(flags)}: {model.name} has its own compile and optimizers ({names}), "
                        f"which hvdtrain keeps as written; set these in your compile")
    if not found:  # (one that is found but never steps, the check at every epoch's end stops)
        raise UserError(f"{model.name} has its own compile, and hvdtrain found no optimizer among its "
                        f"attributes to average the gradients of; keep each optimizer in an attribute "
                        f"of the model (self.d_optimizer = d_optimizer)")
    rates, notes, infos = {}, [], []
    for name, opt in found.items():
        again = optimizer.made(opt)
        if again is not None and again.settings == optimizer.settings(cfg):
            info = again.info
        else:
            compiled = again.compiled if again is not None else opt
            plain, info, said = optimizer.choose(cfg, compiled)
            notes += [f"{name}: {n}" for n in said]
            dist = optimizer.distributed(plain, cfg, loss_scale=False)
            optimizer.remember(dist, compiled, cfg, info)
            setattr(model, name, dist)
        rates[name] = optimizer.LearningRate(cfg, info["lr"], info["schedule"])
        infos.append(f"{name} ({info['class']})")
    _calls_as_planned(model, plan)
    if compat.keras3():
        model.jit_compile = plan.kwargs["jit_compile"]
    own = [i for i in infos if not i.startswith("optimizer ")] or infos  # not Keras' default, unused
    notes.append(f"{model.name} keeps its own compile: its optimizers {', '.join(own)} average their "
                 f"gradients over the workers, each at its learning rate's rule")
    first = found.get("optimizer") and len(found) == 1
    return {**(info if first else {"class": ", ".join(own), "lr": None, "schedule": None, "config": {}}),
            "source": "its own compile"}, rates, notes


def _decisions(model, cfg: Config, data, plan, per_batch: list) -> dict:
    """What each rank decided, on its own view, that shapes the traced step or the order of the
    collectives (docs/reliability.md lists them with how each is made the same)."""
    import tensorflow as tf

    return {
        "steps per call": plan.steps_per_execution,
        "callbacks acting per batch": per_batch,
        "the train step": f"{type(model).__qualname__}.train_step"
                          f"{' (its own)' if type(model).train_step is not tf.keras.Model.train_step else ''}",
        "precision": tf.keras.mixed_precision.global_policy().name,
        "loss scaling": isinstance(model.optimizer, tf.keras.mixed_precision.LossScaleOptimizer),
        "jit_compile": plan.kwargs.get("jit_compile"),
        "steps per epoch": data.steps_per_epoch,
        "batch size": data.batch_size,
        "batches": str(data.element_spec),
        "validation": data.val is not None,
        **{f"--{k.replace('_', '-')}": v for k, v in cfg.to_dict().items() if k not in LOCAL_SETTINGS},
    }


# settings that may differ between ranks: what a rank prints, how many threads it computes with, and the
# paths only rank 0 reads or writes (a node-local output dir per rank is fine: rank 0 decides and broadcasts)
LOCAL_SETTINGS = ("verbose", "log_every", "threads", "worker_logs", "config", "output_dir", "resume",
                  "horovod_timeline", "tensorboard")


def _xla_only_where_horovod_has_it(plan, cfg: Config, world: runtime.World):
    """XLA compiles the whole step, Horovod's allreduce included, which needs Horovod's XLA kernels (behind
    HOROVOD_ENABLE_XLA_OPS=1, which --jit-compile sets). Where there are none, the step fails to compile at
    the first batch, at one worker too (the allreduce sits in a cond): say so before."""
    import tensorflow as tf

    why = horovod_lacks_xla_kernels(world.device, tf.__version__)
    if not plan.kwargs.get("jit_compile") or not why:
        return
    if cfg.jit_compile:
        raise UserError(f"--jit-compile: XLA cannot compile Horovod's allreduce {why}; drop --jit-compile")
    plan.kwargs["jit_compile"] = False
    plan.notes.append(f"the model was compiled with jit_compile=True: XLA is off, since it cannot compile "
                      f"Horovod's allreduce {why}")


def horovod_lacks_xla_kernels(device: str, tf_version: str) -> str:
    """Why Horovod has no XLA kernels for its ops on these workers, or "" where it has them: Horovod 0.28.1
    has them for GPUs only, and hvdtrain's set-up leaves them out of builds against TensorFlow 2.20+, whose
    wheel lacks headers they include (scripts/setup.sh)."""
    if not device.startswith("GPU"):
        return "on CPU workers (Horovod has XLA kernels for GPUs only)"
    if tuple(int(part) for part in tf_version.split(".")[:2]) >= (2, 20):
        return (f"with TensorFlow {tf_version} (set-up leaves Horovod's XLA kernels out of builds against "
                f"TensorFlow 2.20+, whose wheel lacks headers they include)")
    return ""


def _refuse_data_without_targets(model, element_spec):
    """Keras' own train_step needs targets for a compiled loss. Without them Keras 2 says so inside the
    first step and Keras 3 fails there with "None values not supported": say it before training."""
    import tensorflow as tf

    loss = compat.compile_config(model).get("loss")
    if loss is None or type(model).train_step is not tf.keras.Model.train_step:
        return
    if tf.keras.utils.unpack_x_y_sample_weight(element_spec)[1] is None:
        raise UserError(f"Target data is missing: the data give inputs only, and the model was compiled with "
                        f"loss={models.describe(loss)}; return (x, y) pairs from the data")


def _zeros_like(element_spec):
    """(x, y, sample_weight) of one batch of zeros shaped as the data's, an unknown length as 1."""
    import tensorflow as tf

    x, y, w = tf.keras.utils.unpack_x_y_sample_weight(element_spec)  # y, w: None when absent
    return tf.nest.map_structure(
        lambda s: None if s is None else tf.zeros([1] + [d or 1 for d in s.shape[1:]], s.dtype), (x, y, w))


def _build_model(model, element_spec):
    """A model whose layers make their weights at its first call (a keras.Model subclass written as
    keras.io does) is called once, on zeros shaped as the data: its weights must exist before rank 0's
    are broadcast and the optimizer's slots built, as plain Keras builds it before its first step."""
    import tensorflow as tf

    if model.built and model.weights:
        return
    if model.weights and type(model).call is tf.keras.Model.call:
        # a model that holds built models and has no call() (keras.io's GAN) has nothing of its own
        # to build: marked built, as Keras' Layer.build marks a layer without weights, so that its
        # weights can be saved (Keras 3 refuses to save a model not marked built)
        model.built = True
        return
    x, _, _ = _zeros_like(element_spec)
    try:
        model(x, training=False)
    except (ValueError, TypeError, tf.errors.OpError) as e:
        raise UserError(f"{model.name} has no weights yet and could not be called on a batch shaped as the "
                        f"data ({type(e).__name__}: {str(e)[:200]}); build it before hvdtrain.fit: "
                        f"model.build(input_shape), or call it on a batch") from None


def _sparse_classes(model, loss, element_spec) -> int | None:
    """The classes a sparse categorical crossentropy takes labels of (the width of the model's one
    output), or None for any other loss: TrainStep checks the labels against it, so that a label out
    of range is reported as plain Keras reports it, whichever op of the step meets it first."""
    import tensorflow as tf

    names = ("sparse_categorical_crossentropy", "SparseCategoricalCrossentropy")
    sparse = loss in names if isinstance(loss, str) else \
        isinstance(loss, tf.keras.losses.SparseCategoricalCrossentropy) or \
        getattr(loss, "__name__", None) == "sparse_categorical_crossentropy"
    y = tf.keras.utils.unpack_x_y_sample_weight(element_spec)[1]
    if not sparse or not isinstance(y, tf.TensorSpec):
        return None
    try:
        out = model(_zeros_like(element_spec)[0], training=False)
    except (ValueError, TypeError, tf.errors.OpError) as e:  # data the model cannot take: its step says so
        runtime.fallback("label-check", f"{model.name}: the labels are not checked against the model's classes, "
                                        f"since it could not be called on zeros shaped as the data", e)
        return None
    return int(out.shape[-1]) if tf.is_tensor(out) and out.shape.rank and out.shape[-1] else None


def _build_loss_and_metrics(model, element_spec):
    """Keras builds the compiled loss and metrics inside the first step, and a tf.function whose first
    trace creates variables is traced a second time: the whole step, twice (about 2 s of ResNet-50's
    first epoch at 2 workers, measured). Built here, on one batch of zeros, the step is traced once.

    Only for Keras' own train_step, compute_loss and compute_metrics, and only when the targets' and
    weights' shapes are known beyond the batch, since Keras picks an accuracy (sparse, categorical,
    binary) from them; an input's unknown length (padded sequences) is 1 here. Anything else, or a
    model that refuses the zeros, is left to Keras, as before."""
    import tensorflow as tf

    own = all(getattr(type(model), m) is getattr(tf.keras.Model, m)
              for m in ("train_step", "compute_loss", "compute_metrics"))
    if not own or compat.own_loss_and_metrics_are_built(model) is not False:
        return
    x, y, w = tf.keras.utils.unpack_x_y_sample_weight(element_spec)  # y, w: None when absent

    def specs(*parts):
        return [s for s in tf.nest.flatten(parts) if s is not None]

    if not all(type(s) is tf.TensorSpec and s.shape.rank for s in specs(x, y, w)) or not all(
            s.shape[1:].is_fully_defined() for s in specs(y, w)):
        return
    x, y, w = _zeros_like(element_spec)
    try:
        y_pred = model(x, training=False)
        model.compute_loss(x, y, y_pred, w)
        model.compute_metrics(x, y, y_pred, w)
    except Exception as e:  # noqa: BLE001 (whatever the model raises on zeros; said, and raises under the tests)
        runtime.fallback("build-loss", f"{model.name}: the loss and metrics are built in the first step, which Keras "
                                       f"then traces twice, since the model could not be called on zeros", e)
    model.reset_metrics()
