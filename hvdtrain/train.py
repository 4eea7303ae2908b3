"""The training path: config -> hvd.init and device pinning -> shard -> model -> model.fit -> summary.

`run(cfg)` is `python -m hvdtrain`; `fit(model, data, ...)` is the Python API; both are this one path.
It is the Horovod recipe for Keras, in order: pin one device per worker; read this worker's shard;
build (or take) the model and keep its compile; scale the learning rate and wrap the optimizer in
hvd.DistributedOptimizer (optimizer.py); start every rank from rank 0's state; fit, the ranks agreeing
at every epoch's end (callbacks.py); and let rank 0 alone print and write.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import glob
import hashlib
import json
import math
import os
import re
import socket
import time

from . import callbacks as callbacks_lib
from . import checkpoint, compat, models, optimizer, preemption, runtime, watchdog
from . import config as config_lib
from . import data as data_lib
from .checkpoint import Checkpoints
from .config import Config, UserError
from .runtime import log, rank0_only


# ---------------------------------------------------------------- the Python API

def init(**config) -> runtime.World:
    """hvd.init(), pin this worker's GPU (or CPU threads), seed, precision: call it before building
    the model. Takes the same keys as hvdtrain.fit (threads, seed, precision, Horovod's knobs...)."""
    runtime.report_errors_once()
    return start(config_lib.from_dict(config).validate(model_object=True, data_object=True))


def fit(model, data, validation_data=None, callbacks=None, **config) -> dict:
    """Train `model` on `data` across the job's workers, as `python -m hvdtrain` would; returns the
    summary (rank 0 also writes it, with the model and checkpoints, under output_dir).

    model: a tf.keras.Model (compiled or not), or a model name / module:function.
    data: a tf.data.Dataset, a function returning one (taking a DataContext, it shards itself), a
        (train, val) pair of them, (x, y) arrays, or a --data string.
    callbacks: Keras callbacks, as model.fit takes them: they see the metrics of all workers; the
        ones that write files run on rank 0 (hvdtrain.on_rank0 marks your own); a change they make to
        the learning rate trains.
    config: any of `python -m hvdtrain --help`'s fields (epochs=5, batch_size=64, output_dir=...).
    """
    runtime.report_errors_once()
    for key in ("model", "data", "config"):
        if key in config:
            raise UserError(f"hvdtrain.fit: pass {key} positionally, not as a config key")
    model_object, data_object = not isinstance(model, str), not isinstance(data, str)
    if isinstance(callbacks, str):  # "module:function", as --callbacks takes it
        config["callbacks"], callbacks = callbacks, None
    cfg = config_lib.from_dict({**config, "model": _label(model), "data": _label(data)}).validate(
        model_object=model_object, data_object=data_object)
    cfg, notes = _own_dir_per_fit(cfg)
    return run(cfg, model if model_object else None, data if data_object else None, validation_data,
               callbacks, notes)


_FITS = collections.Counter()  # run dir -> the hvdtrain.fit calls of this process that trained there


def _own_dir_per_fit(cfg: Config) -> tuple:
    """The n-th fit() of a script on one run dir (transfer learning, then fine-tuning) trains in its
    own sub-directory, run_dir/fit-n: each phase keeps its checkpoints, and the script run again
    finds every phase where it left it (a finished one is restored, an interrupted one resumed)."""
    _FITS[os.path.abspath(cfg.run_dir)] += 1
    n = _FITS[os.path.abspath(cfg.run_dir)]
    if n == 1:
        return cfg, []
    own = dataclasses.replace(cfg, output_dir=os.path.join(cfg.run_dir, f"fit-{n}"))
    return own, [f"fit() {n} of this script on {cfg.run_dir}: it trains in {own.run_dir}"]


def _label(obj) -> str:
    """What names a model or data object in the output dir, the log and the summary: a model's name,
    a function's, else what it holds ("dataset" for one or a (train, val) pair, "arrays" for (x, y))."""
    if isinstance(obj, str):
        return obj
    import tensorflow as tf

    if isinstance(obj, tf.keras.Model):
        return obj.name
    if isinstance(obj, tf.data.Dataset):
        return "dataset"
    if isinstance(obj, (tuple, list)):
        return "dataset" if all(isinstance(o, tf.data.Dataset) for o in obj if o is not None) else "arrays"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", getattr(obj, "__name__", None) or type(obj).__name__)


# ---------------------------------------------------------------- one path

def start(cfg: Config) -> runtime.World:
    """Everything that must happen before a model is built: hvd.init, pinning, seed, precision."""
    import tensorflow as tf

    world = runtime.init(cfg.threads, cfg.horovod_env())
    tf.keras.utils.set_random_seed(cfg.seed)
    if cfg.deterministic:
        tf.config.experimental.enable_op_determinism()
    tf.keras.mixed_precision.set_global_policy(cfg.precision)
    return world


def run(cfg: Config, model=None, data=None, validation_data=None, callbacks=None, notes=()) -> dict:
    t0 = time.time()
    elastic = runtime.launched_elastic()
    if cfg.elastic and not elastic:
        raise UserError("--elastic needs an elastic launch: horovodrun -np N --min-np MIN --max-np MAX "
                        "--host-discovery-script SCRIPT python -m hvdtrain ... (see docs/reliability.md)")
    callbacks = callbacks_lib.users(callbacks, cfg)
    world = start(cfg)
    # from here on, a scheduler's SIGTERM stops every rank at one step, after a checkpoint (preemption.py)
    with preemption.handling(() if elastic else cfg.preemption_signals):
        return _run_started(cfg, world, elastic, t0, model, data, validation_data, callbacks, notes)


def _run_started(cfg: Config, world: runtime.World, elastic: bool, t0: float, model, data, validation_data,
                 callbacks: list, notes) -> dict:
    runtime.setup_logging(os.path.join(cfg.run_dir, "logs", f"rank{world.rank}.log")
                          if cfg.worker_logs else None)
    host = socket.gethostname()
    log.info("rank %d/%d (local %d/%d) on %s, pid %d: %s", world.rank, world.size, world.local_rank,
             world.local_size, host, os.getpid(), world.device, extra=runtime.EVERY_RANK)
    _warn_if_stall_check_is_blind(cfg, world)
    # An elastic worker can join a running job alone: until hvd.elastic.run has synced it with the
    # others, it must not call a collective, so set-up errors are not agreed on there.
    agree = (lambda fn, *args: fn(*args)) if elastic else runtime.all_ranks_agree
    done = None if elastic else agree(_finished_run, cfg)
    if done is not None and model is None:
        _say_finished(cfg, done, "nothing to do")
        return done

    need_classes = models.needs_classes(cfg.model) if model is None and cfg.num_classes is None else None
    shard = functools.partial(load_data, cfg, source=data, validation=validation_data, need_classes=need_classes)
    if elastic:  # here the data only give the model its shapes; every elastic round shards them anew
        with runtime.alone():
            data = shard(world)
    else:
        data = agree(shard, world)
    cfg = dataclasses.replace(cfg, batch_size=data.batch_size)
    if model is None:
        model = agree(models.build, cfg.model, data)
    callbacks = callbacks_lib.for_this_rank(callbacks, world.is_chief)
    cfg, trainer = agree(compile_for_training, model, cfg, world, data.steps_per_epoch,
                         callbacks_lib.has_batch_hooks(callbacks))
    trainer.callbacks = callbacks
    _refuse_data_without_targets(model, data.element_spec)
    _build_loss_and_metrics(model, data.element_spec)
    for note in [*notes, *([] if elastic else data.notes), *trainer.notes]:
        log.info(note)
    _say_if_step_checkpoints_cannot_resume(cfg, data)
    ckpts = Checkpoints(cfg, model)
    if done is not None:  # a finished fit() of a script run again: its model leaves as it was trained
        ckpts.restore_and_broadcast()
        _say_finished(cfg, done, "its final weights and optimizer state are back in the model")
        return done
    startup_s = time.time() - t0  # launch to the first step: data found, counted and sharded, model built
    broadcast_s, started_at = None, None  # rank 0's state to every rank; the wall-clock time training began
    try:
        if elastic:
            (history, epoch_end), data, rounds = fit_elastic(cfg, model, shard, ckpts, trainer)
            first_epoch, first_step = rounds[0]["from_epoch"], rounds[0]["from_step"]
        else:
            t = time.time()
            (first_epoch, first_step), rounds = ckpts.restore_and_broadcast(), []
            broadcast_s, started_at = time.time() - t, time.time()
            _say_how_it_resumes(cfg, ckpts, world, model)
            first_step = replayable_step(cfg, data, first_epoch, first_step)
            history, epoch_end = fit_fixed(cfg, model, data, world, ckpts, first_epoch, trainer, first_step)
    except optimizer.NonFiniteUpdate as e:
        raise UserError(str(e)) from None
    except preemption.Preempted as e:
        log.info("%s", e, extra=runtime.FILE_ONLY)
        raise

    world = runtime.world()
    per_worker = runtime.gather(epoch_end.samples_per_sec())
    summary = {
        "world_size": world.size,
        "hosts": sorted(set(runtime.gather(host))),
        "epochs": cfg.epochs,
        "first_epoch": first_epoch,
        "first_step": first_step,
        "epochs_run": len(history.epoch),
        "last_epoch": first_epoch + len(history.epoch),
        "steps_per_epoch": data.steps_per_epoch,
        "batch_size_per_worker": data.batch_size,
        "steps_per_execution": trainer.steps_per_execution,
        "global_batch_size": data.batch_size * world.size * cfg.backward_passes_per_step,
        "data": {"sharding": data.sharding, "samples": data.num_samples,
                 "validation": data.val is not None},
        "model": {"name": model.name, "loss": trainer.loss,
                  # what every step allreduces (bench: compute time against bytes / bandwidth)
                  "gradient_bytes": sum(v.shape.num_elements() * v.dtype.size
                                     for v in compat.tf_variables(model.trainable_variables))},
        "optimizer": {**trainer.optimizer, "lr_scaled": trainer.peak_lr(world)},
        "metrics": {k: float(v[-1]) for k, v in history.history.items()},
        # every epoch of this run: its metrics, and its training time (validation left out)
        "history": {**{k: [float(x) for x in v] for k, v in history.history.items()},
                    "epoch_seconds": epoch_end.epoch_seconds},
        "samples_per_sec_per_worker": per_worker,
        "samples_per_sec_total": sum(per_worker),
        "wall_time_s": time.time() - t0,
        "startup_s": max(runtime.gather(startup_s)),
        "broadcast_s": max(runtime.gather(broadcast_s)) if broadcast_s is not None else None,
        "training_started_at": max(runtime.gather(started_at)) if started_at is not None else None,  # time.time()
        "checkpoint_save_s": ckpts.save_seconds,  # rank 0's: the others wait for it at the next step
        "weights_sha256_by_rank": runtime.gather(weights_sha256(model)),
        "precision": {"policy": _policy(), "loss_scaling": _loss_scaling(model)},
        "elastic_rounds": rounds,
        "runtime_env": runtime.applied_defaults(),
        "stack": compat.stack(),  # Python, TensorFlow, Keras, numpy
        "config": cfg.to_dict(),
    }
    _write_outputs(cfg, model, summary)
    log.info("done: %s", json.dumps(summary["metrics"]))
    return summary


def load_data(cfg: Config, world: runtime.World, source=None, validation=None,
              need_classes=None) -> data_lib.Data:
    """This worker's shard, in whole updates (a multiple of backward_passes_per_step steps)."""
    data = data_lib.load(cfg, world, source, validation, need_classes)
    if cfg.num_classes is not None:
        data.num_classes = cfg.num_classes
    data.steps_per_epoch -= data.steps_per_epoch % cfg.backward_passes_per_step
    if data.steps_per_epoch == 0:
        raise UserError(f"--backward-passes-per-step {cfg.backward_passes_per_step} is more than the "
                        f"steps in an epoch; lower it or --batch-size")
    return data


@dataclasses.dataclass
class Trainer:
    """What compile_for_training decided: for the fit loop, the summary and the log."""
    learning_rate: object  # optimizer.LearningRate, or None (a compiled schedule runs as is)
    optimizer: dict
    loss: str
    steps_per_execution: int
    notes: list
    cfg: Config
    callbacks: list = dataclasses.field(default_factory=list)  # the user's, those this rank runs

    def peak_lr(self, world) -> float | None:
        lr = self.optimizer["lr"]
        return None if lr is None else lr * optimizer.lr_multiplier(self.cfg, world)


def compile_for_training(model, cfg: Config, world: runtime.World, steps_per_epoch: int,
                         batch_callbacks: bool = False):
    """Compile `model` as its user did (or as the flags say), with the optimizer scaled and wrapped;
    returns (cfg with the one-worker lr it trains with, Trainer). batch_callbacks: the user's
    callbacks act per batch, so Keras calls them every step, as in plain Keras (1 step per call)."""
    plan = models.compile_plan(model, cfg, steps_per_epoch, batch_callbacks)
    _xla_only_where_horovod_has_it(plan, cfg, world)
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
    cfg = dataclasses.replace(cfg, lr=info["lr"] if info["lr"] is not None else cfg.lr)
    model.compile(optimizer=dist, **plan.kwargs)
    model.autotune_steps_per_execution = False  # Keras' compile leaves a user's "auto" tuner on
    model.steps_per_execution = plan.steps_per_execution  # the compile config keeps the user's own
    if cfg.reduction == "adasum":
        optimizer.use_adasum(model, cfg, world)
    learning_rate = optimizer.LearningRate(cfg, info["lr"]) if info["lr"] is not None else None
    optimizer.wrap_train_step(model, learning_rate)
    log.info("%s: loss %s; %s from %s, lr %s for one worker; %d step(s) per call", model.name, plan.loss,
             info["class"], info["source"], "a schedule" if info["lr"] is None else f"{info['lr']:g}",
             plan.steps_per_execution)
    return cfg, Trainer(learning_rate, info, plan.loss, plan.steps_per_execution, plan.notes + notes, cfg)


def _xla_only_where_horovod_has_it(plan, cfg: Config, world: runtime.World):
    """XLA compiles the whole step, Horovod's allreduce included, and Horovod 0.28.1 has XLA kernels for
    its ops only on GPUs (behind HOROVOD_ENABLE_XLA_OPS=1, which --jit-compile sets): on CPU workers
    the step fails to compile at the first batch, at one worker too (the allreduce sits in a cond)."""
    if not plan.kwargs.get("jit_compile") or world.device.startswith("GPU"):
        return
    if cfg.jit_compile:
        raise UserError("--jit-compile: XLA cannot compile Horovod's allreduce on CPU workers (Horovod has "
                        "XLA kernels for GPUs only); drop --jit-compile")
    plan.kwargs["jit_compile"] = False
    plan.notes.append("the model was compiled with jit_compile=True: XLA is off, since it cannot compile "
                      "Horovod's allreduce on CPU workers (Horovod has XLA kernels for GPUs only)")


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
    x, y, w = tf.nest.map_structure(
        lambda s: None if s is None else tf.zeros([1] + [d or 1 for d in s.shape[1:]], s.dtype), (x, y, w))
    try:
        y_pred = model(x, training=False)
        model.compute_loss(x, y, y_pred, w)
        model.compute_metrics(x, y, y_pred, w)
    except Exception as e:  # noqa: BLE001 (only the second trace is at stake)
        log.debug("the loss and metrics are left to the first step: %s", e)
    model.reset_metrics()


def _finished_run(cfg: Config):
    """The summary of a run already trained to its last epoch, or None: rank 0 looks, all agree.

    A finished run re-launched with the same command is left alone; a fresh start in a used output
    dir moves the old run's files aside instead of overwriting them."""
    decision = None
    if runtime.world().is_chief:
        path = checkpoint.find(cfg)
        epoch = checkpoint.epoch_of(path) if path else 0
        if path and epoch >= cfg.epochs:
            decision = {**_read_summary(cfg), "last_epoch": epoch}
        elif not path:
            _keep_previous_run(cfg)
    return runtime.gather(decision)[0]


def _say_finished(cfg: Config, summary: dict, what: str):
    runtime.say(f"hvdtrain: already trained to epoch {summary['last_epoch']} of {cfg.epochs} in {cfg.run_dir}: "
                f"{what}; --epochs N (hvdtrain.fit: epochs=N) trains further; --no-auto-resume "
                f"(auto_resume=False) or another --output-dir starts over")


def _read_summary(cfg: Config) -> dict:
    path = os.path.join(cfg.run_dir, "summary.json")
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {"run_dir": cfg.run_dir}


OUTPUTS = ("summary.json", "model.keras", "model.weights.h5", "best.weights.h5", "checkpoints")


def _keep_previous_run(cfg: Config, keep=(), why="starting afresh"):
    """Rank 0, starting afresh where a run already wrote its results (or about to write results that
    cover fewer epochs than the ones there): move them to previous/<time>, never overwrite them."""
    later_fits = sorted(os.path.basename(d) for d in glob.glob(os.path.join(cfg.run_dir, "fit-[0-9]*")))
    found = [name for name in OUTPUTS if name not in keep and os.path.exists(os.path.join(cfg.run_dir, name))]
    found += later_fits if found and "checkpoints" not in keep else []
    if not found:
        return
    where = os.path.join(cfg.run_dir, "previous", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(where, exist_ok=True)
    for name in found:
        os.replace(os.path.join(cfg.run_dir, name), os.path.join(where, name))
    runtime.say(f"hvdtrain: {why} in {cfg.run_dir}; the previous run's {', '.join(found)} "
                f"moved to {where}")


def _say_how_it_resumes(cfg: Config, ckpts: Checkpoints, world: runtime.World, model):
    if ckpts.resumed_from is None:
        return
    before = ckpts.resumed_from.get("world_size")
    if before and before != world.size:
        log.info("resuming a run of %d workers with %d: the learning rate is scaled for %d workers",
                 before, world.size, world.size)
    random = compat.random_layers(model)
    if random:  # Keras' random layers keep their generator's state in kernels, not in the checkpoint
        log.info("resuming: %s draw%s new random numbers after a restart, so the weights will differ from "
                 "an uninterrupted run's", ", ".join(random[:3]),
                 "" if len(random) > 1 else "s")


def _warn_if_stall_check_is_blind(cfg: Config, world: runtime.World):
    """Horovod 0.28.1's stall check reports only under the MPI controller: under Gloo, rank 0's
    background loop waits in its per-cycle gather for the stalled rank and never gets to the check
    (measured, docs/reliability.md). Say so rather than let a user wait for a warning that never comes."""
    import horovod.tensorflow as hvd

    if (cfg.stall_check_seconds or cfg.stall_shutdown_seconds) and world.size > 1 and not hvd.mpi_enabled():
        log.warning("--stall-check-seconds/--stall-shutdown-seconds: Horovod's stall check does not "
                    "report under the Gloo controller; launch with horovodrun --mpi or mpirun for it")


# ---------------------------------------------------------------- fit

def keras_callbacks(cfg: Config, data: data_lib.Data, world: runtime.World, trainer: Trainer, saver,
                    epoch_end, progress, extra=()):
    """hvdtrain's agreement at epoch end first: every callback after it (the user's, early stopping,
    best model, TensorBoard, checkpoints, progress) sees metrics combined over all workers, so every
    rank takes the same decisions."""
    import tensorflow as tf

    cbs = [epoch_end]
    if trainer.callbacks:
        if trainer.learning_rate is not None:
            before, after = callbacks_lib.following_the_learning_rate(
                trainer.learning_rate, callbacks_lib.has_batch_hooks(trainer.callbacks))
            cbs += [before, *trainer.callbacks, after]
        else:
            cbs += trainer.callbacks
    cbs += extra
    if cfg.early_stopping_patience:
        cbs.append(tf.keras.callbacks.EarlyStopping(monitor=cfg.monitor,
                                                    patience=cfg.early_stopping_patience))
    if world.is_chief and cfg.keep_best and (data.val is not None or not cfg.monitor.startswith("val_")):
        cbs.append(tf.keras.callbacks.ModelCheckpoint(os.path.join(cfg.run_dir, "best.weights.h5"),
                                                      monitor=cfg.monitor, save_best_only=True,
                                                      save_weights_only=True))
    if world.is_chief and cfg.tensorboard:
        cbs.append(tf.keras.callbacks.TensorBoard(os.path.join(cfg.run_dir, "tensorboard"),
                                                  profile_batch=0))
    if saver is not None:
        cbs.append(saver)
    if progress is not None:
        cbs.append(progress)
    return cbs


def fit_on_shard(cfg: Config, model, data, world: runtime.World, ckpts, first_epoch: int,
                 trainer: Trainer, extra_callbacks=(), first_step: int = 0):
    """model.fit over this worker's shard from step `first_step` of epoch first_epoch + 1; returns
    (history, the EpochEnd callback). A resume inside an epoch fits the rest of that epoch first."""
    if cfg.monitor.startswith("val_") and data.val is None and cfg.early_stopping_patience:
        raise UserError(f"--early-stopping-patience watches {cfg.monitor}, but there is no validation "
                        f"data: return (train, val) from the data function, or give --val-split")
    sharded = {"yours": "sharded by the data function", "none": "one worker: not sharded"}.get(
        data.sharding, f"sharded by {data.sharding}")
    log.info("%s on %s%s, %s: %d steps/epoch of %d per worker, %d workers, epochs %d..%d%s", model.name,
             cfg.data, f" ({data.num_samples} samples)" if data.num_samples else "", sharded,
             data.steps_per_epoch, data.batch_size, world.size, first_epoch + 1, cfg.epochs,
             f" (from step {first_step + 1})" if first_step else "")
    import tensorflow as tf

    epoch_end, progress = callbacks_lib.make(cfg, data, world.size, world.is_chief)
    saver = callbacks_lib.checkpoints(cfg, ckpts, data.steps_per_epoch, first_epoch, first_step,
                                      trainer.steps_per_execution)
    callbacks = keras_callbacks(cfg, data, world, trainer, saver, epoch_end, progress, extra_callbacks)
    if cfg.preemption_signals and not cfg.elastic and preemption.usable(world):
        callbacks.append(preemption.watcher(ckpts, data.steps_per_epoch, first_epoch, first_step))
    iteration = int(model.optimizer.iterations.numpy()) - first_step  # at the start of first_epoch
    if trainer.learning_rate is not None:
        trainer.learning_rate.start(optimizer.lr_multiplier(cfg, world), first_epoch, iteration,
                                    data.steps_per_epoch)
    parts, class_weight = [], cfg.class_weights()
    try:
        if first_step:  # the rest of a resumed epoch: Keras' epochs all have steps_per_epoch steps
            parts.append(model.fit(data.stream(first_epoch, first_epoch + 1, skip=first_step),
                                   epochs=first_epoch + 1, initial_epoch=first_epoch,
                                   steps_per_epoch=data.steps_per_epoch - first_step,
                                   class_weight=class_weight, callbacks=callbacks, verbose=0,
                                   shuffle=False))  # the data are shuffled already (Keras 3 warns)
        start = first_epoch + len(parts)
        if start < cfg.epochs and not (parts and model.stop_training):
            parts.append(model.fit(data.stream(start, cfg.epochs), epochs=cfg.epochs, initial_epoch=start,
                                   steps_per_epoch=data.steps_per_epoch, class_weight=class_weight,
                                   callbacks=callbacks, verbose=0, shuffle=False))
    except tf.errors.InvalidArgumentError as e:
        step = optimizer.NonFiniteUpdate.step_of(e)
        if step is None:
            raise
        done = step - iteration
        raise optimizer.NonFiniteUpdate(first_epoch + done // data.steps_per_epoch + 1,
                                        done % data.steps_per_epoch + 1) from None
    finally:
        if progress is not None:
            progress.stop.set()
    history = parts[0]
    for later in parts[1:]:
        history.epoch += later.epoch
        for k, v in later.history.items():
            history.history.setdefault(k, []).extend(v)
    return history, epoch_end


def _unreplayable(data) -> str | None:
    """Why the data cannot give an epoch's order again from a step inside it (None: they can)."""
    return data.unrepeatable or ("it is one stream across epochs" if data.epoch is None else None)


def replayable_step(cfg: Config, data, first_epoch: int, first_step: int) -> int:
    """The step a resume inside an epoch continues at: first_step, or 0 (the epoch restarts, and the
    log says why) when the data cannot give that epoch's order again from there."""
    why = _unreplayable(data) or (f"the epoch now has {data.steps_per_epoch} steps"
                                  if first_step >= data.steps_per_epoch else None)
    if first_step and why:
        log.info("resuming inside epoch %d: %s cannot continue at step %d, because %s; the epoch "
                 "restarts from its first step", first_epoch + 1, cfg.data, first_step + 1, why)
        return 0
    return first_step


def _say_if_step_checkpoints_cannot_resume(cfg: Config, data):
    """Before any crash: checkpoints inside an epoch that a resume could not continue from."""
    inside = cfg.checkpoint_every_minutes or 0 < cfg.checkpoint_every_steps < data.steps_per_epoch
    why = _unreplayable(data)
    if inside and why:
        log.info("checkpoints inside an epoch: a resume cannot continue %s where it stopped, because %s; "
                 "it would restart that epoch from its first step", cfg.data, why)


def fit_fixed(cfg: Config, model, data, world: runtime.World, ckpts, first_epoch: int, trainer: Trainer,
              first_step: int = 0):
    """A fixed set of workers. If a step fails, its rank names the cause in one line; if a worker
    dies, the survivors name every worker so the dead one can be found; if one hangs, the watchdog
    names it and ends the job."""
    dog = watchdog.Watchdog(cfg, world, resume_point=lambda: ckpts.last_saved)
    workers = dog.workers  # every rank's (host, pid)
    iteration = int(model.optimizer.iterations.numpy()) - first_step
    try:
        return fit_on_shard(cfg, model, data, world, ckpts, first_epoch, trainer, first_step=first_step)
    except (optimizer.NonFiniteUpdate, UserError, KeyboardInterrupt, preemption.Preempted):
        raise
    except Exception as e:
        dog.on_failure()  # a hung peer's silence explains it: the watchdog names it
        done = int(model.optimizer.iterations.numpy()) - iteration
        after = getattr(e, "hvdtrain_validating_after_epoch", None)  # set by callbacks.EpochEnd
        what, where = ("validation", f"after epoch {after}") if after else (
            "the training step",
            f"at epoch {first_epoch + done // data.steps_per_epoch + 1}, step {done % data.steps_per_epoch + 1}")
        _report_training_failure(e, what, where, world, workers)
    finally:
        dog.stop()


def _report_training_failure(e, what: str, where: str, world, workers):
    """One line for the cause, from the rank that hit it; the traceback in that rank's log file.

    Horovod gives every other rank the same words whether a peer died or a peer's own step raised (and
    that peer reports why), so a survivor looks: a peer on this host whose process is gone died."""
    text = str(e)
    # a peer's failure reaches this rank as Horovod's shutdown; an invalid step (one that XLA cannot
    # compile, say) is this rank's own, even where its text names Horovod's ops
    horovod = "horovod" in f"{type(e).__module__} {text}".lower() and \
        type(e).__name__ != "InvalidArgumentError"
    if horovod and world.size > 1:
        host = socket.gethostname()
        table = ", ".join(f"rank {r} on {h} (pid {p})" for r, (h, p) in enumerate(workers))
        gone = [f"rank {r} (pid {p})" for r, (h, p) in enumerate(workers) if h == host and not _alive(p)]
        remote = any(h != host for h, _ in workers)
        if gone:
            log.error("rank %d lost its peers during training (%s on %s exited). Workers were: %s. The "
                      "launcher names the one that exited first.", world.rank, ", ".join(gone), host, table,
                      extra=runtime.EVERY_RANK)
        elif remote:
            log.error("rank %d stopped: Horovod shut down (%s): a worker on another host died, or its "
                      "training step failed and it reports why. Workers were: %s. A stall shutdown is "
                      "reported above by Horovod.", world.rank, text.strip().splitlines()[0][:120], table,
                      extra=runtime.EVERY_RANK)
        else:  # every peer is alive on this host: one's own step failed, and it reports why
            log.error("rank %d stopped: a peer's training step failed (it reports why)", world.rank,
                      extra=runtime.FILE_ONLY)
        raise SystemExit(1)
    log.error("%s failed on rank %d", what, world.rank, exc_info=e, extra=runtime.FILE_ONLY)
    logfile = f"; traceback in {log_file()}" if log_file() else ""
    raise runtime.TrainingFailed(f"{what} failed on rank {world.rank} {where}: {explain(e)}{logfile}") from None


def _alive(pid: int) -> bool:
    """Is this process running (a zombie, dead but not yet reaped by the launcher, is not)?"""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def log_file() -> str | None:
    for h in log.handlers:
        if hasattr(h, "baseFilename"):
            return h.baseFilename
    return None


def explain(e: Exception) -> str:
    """The op and the message that explain a failed step, from TensorFlow's long error text."""
    text, kind = str(e), type(e).__name__
    # several steps per call: Keras' loop over steps hides the step's own error behind AutoGraph's
    # "'outputs' must be defined before the loop", and names it in a note
    hidden = re.search(r"AutoGraph tried to define it automatically, but ran into an? (\w+): ", text)
    if hidden:
        text, kind = text[hidden.end():], hidden.group(1)
    # a Keras layer's error: its message sits between "Exception encountered when calling layer" (Keras 3:
    # "... calling Sequential.call()", in bold) and the arguments of the call
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    text = re.sub(r"(Call arguments|Arguments) received by .*", "", text, flags=re.S)
    text = re.sub(r"Exception encountered when calling [^\n]*", "", text)
    node = re.search(r"\{\{node ([^}]+)\}\}", text) or re.search(r"Detected at node '?([^'\s]+)", text)
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    # TensorFlow puts the cause after the "defined at" traceback and before [[{{node ...}}]]
    cause = [l for l in lines if not l.startswith(("File ", "Detected at node", "[[", "Graph execution",
                                                   "in user code", "Traceback", "Node:"))
             and not re.match(r"^(\S+\.py|<\S+>|\w[\w.]*\(|return |self\.|x = |outputs = )", l)
             and "defined at (most recent call last)" not in l]
    cause = [re.sub(r"\s*\[Op:\S+\]", "", l) for l in cause]
    message = (cause[-1] if cause else lines[-1] if lines else kind)[:400]
    message = re.sub(rf"^{kind}: ", "", message)
    return kind + (f" at {node.group(1)}" if node else "") + f": {message}"


def elastic_commits(cfg: Config, per_call: int, state) -> list:
    """The callbacks that keep hvd.elastic's state: the epoch, and a commit every `commit_every` steps.
    Horovod's CommitStateCallback counts Keras' calls of the step, which run steps_per_execution
    steps each, so it is given calls: a commit at the end of the call that reaches every N steps."""
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    calls = math.ceil(cfg.commit_every / per_call)
    return [
        # Horovod's UpdateEpochStateCallback counts from a fit() that starts at epoch 0; ours passes
        # initial_epoch so schedules and checkpoints see the true epoch, so the epoch is stored as is.
        tf.keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: setattr(state, "epoch", epoch + 1)),
        hvd.elastic.CommitStateCallback(state, batches_per_commit=calls),
    ]


def fit_elastic(cfg: Config, model, shard, ckpts, trainer: Trainer):
    """Training that outlives its workers, with Horovod's elastic API.

    hvd.elastic.run calls `one_round` again after every change of the world: when a worker dies, the
    survivors roll back to the last commit; when hosts join, everyone goes on from the current state
    (`commit_every` steps). Each round starts by syncing rank 0's state to all, then re-shards the data
    and rescales the learning rate for the workers it has. Returns (fit's result, data, rounds).
    """
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf
    from horovod.common.exceptions import HorovodInternalError

    ckpts.restore_on_rank0()  # the first sync hands rank 0's model, optimizer and epoch to everyone
    saved = (ckpts.resumed_from or {}).get("world_size")
    # a step checkpoint's position (and per-rank state) holds for the number of workers that wrote it
    state = compat.elastic_state(model, epoch=int(ckpts.epoch.numpy()), batch=int(ckpts.step.numpy()),
                                   batch_world=saved or 0, ranks=ckpts.ranks)
    rounds, data, sharded_for = [], None, None

    @hvd.elastic.run
    def one_round(state):
        nonlocal data, sharded_for
        world = runtime.refresh()
        if sharded_for is None or (world.rank, world.size) != (sharded_for.rank, sharded_for.size):
            data, sharded_for = shard(world), world
            for note in data.notes:
                log.info(note)
        lr = trainer.peak_lr(world)
        first_step = replayable_step(cfg, data, int(state.epoch),
                                     int(state.batch) if state.batch_world == world.size else 0)
        if first_step and not rounds:
            ckpts.ranks = state.ranks
            ckpts.take_own_state()
        state.batch, state.ranks = 0, None  # a later round (another world) restarts its epoch
        rounds.append({"world_size": world.size, "from_epoch": int(state.epoch), "from_step": first_step,
                       "lr": lr})
        log.info("elastic round %d: %d workers from epoch %d, lr %s", len(rounds), world.size,
                 state.epoch + 1, f"{lr:g}" if lr is not None else "(schedule)")
        try:
            return fit_on_shard(cfg, model, data, world, ckpts, int(state.epoch), trainer,
                                elastic_commits(cfg, trainer.steps_per_execution, state), first_step)
        except tf.errors.OpError as e:
            # hvd.elastic.run rolls back on errors of the ops it names (HorovodAllreduce, ...) and
            # returns None on any other: a lost peer seen by a grouped allreduce must roll back too
            if "horovod" in str(e).lower():
                raise HorovodInternalError(e) from e
            raise

    return one_round(state), data, rounds


# ---------------------------------------------------------------- outputs

def weights_sha256(model) -> str:
    h = hashlib.sha256()
    for w in model.get_weights():  # a lookup layer's vocabulary is an array of Python objects
        h.update("\0".join(map(repr, w.ravel())).encode() if w.dtype == object else w.tobytes())
    return h.hexdigest()


def _policy() -> str:
    import tensorflow as tf

    return tf.keras.mixed_precision.global_policy().name


def _loss_scaling(model) -> bool:
    import tensorflow as tf

    return isinstance(model.optimizer, tf.keras.mixed_precision.LossScaleOptimizer)


def export_model(model, run_dir: str) -> str:
    """Save the model as compiled, with the user's own optimizer class in place of Horovod's wrapper
    (a subclass Horovod makes on the fly, which only Horovod could load) and its slots: model.keras
    loads with plain `tf.keras.models.load_model`, ready to evaluate or train on. A subclassed model,
    which Keras cannot rebuild from a config, is saved as weights (model.weights.h5) for its class."""
    try:
        plain = compat.uncompiled_copy(model)
    except (ValueError, TypeError, NotImplementedError):
        path = os.path.join(run_dir, "model.weights.h5")
        model.save_weights(path)
        return path
    plain.set_weights(model.get_weights())
    if compat.keras3():
        optimizer.copy_vocabularies(model, plain)
    try:
        _compile_as_trained(plain, model)
    except Exception as e:  # a loss or metric Keras cannot rebuild from its config (a lambda, ...)
        log.warning("model.keras is saved without its compile state (%s); compile it after loading", explain(e))
    path = os.path.join(run_dir, "model.keras")
    plain.save(path)
    return path


def _compile_as_trained(plain, model):
    """Compile `plain` as `model` is, with the user's optimizer class (and its slots, from `model`'s)."""
    import tensorflow as tf

    opt = getattr(model.optimizer, "inner_optimizer", model.optimizer)  # under a LossScaleOptimizer
    users = optimizer.user_class(opt).from_config(opt.get_config())
    if opt is not model.optimizer:
        users = tf.keras.mixed_precision.LossScaleOptimizer(users)
    config = model.get_compile_config()
    config["optimizer"] = tf.keras.optimizers.serialize(users)
    plain.compile_from_config(config)
    slots, trained = plain.optimizer.variables, model.optimizer.variables
    if [v.shape for v in slots] == [v.shape for v in trained]:
        for slot, value in zip(slots, trained):
            slot.assign(value)


@rank0_only
def _write_outputs(cfg: Config, model, summary: dict):
    os.makedirs(cfg.run_dir, exist_ok=True)
    if _read_summary(cfg).get("last_epoch", 0) > summary["last_epoch"]:  # e.g. --resume of an early ckpt
        _keep_previous_run(cfg, keep=("checkpoints", "best.weights.h5"), why="this run covers fewer epochs than the one")
    if cfg.save_model:
        summary["model"]["file"] = export_model(model, cfg.run_dir)
    path = os.path.join(cfg.run_dir, "summary.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(summary, fh, indent=2)
    os.replace(path + ".tmp", path)
    runtime.say(f"hvdtrain: wrote {path}")
