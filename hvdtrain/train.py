"""The training path, as Horovod's recipe for Keras: `run` is its steps in order, each a call into the
module that owns it.

  1. hvd.init; pin this worker's device (its GPU by local rank, or CPU threads); seed; precision
  2. a run already trained to its last epoch is left as it is (rundir.py)
  3. this worker's shard of the data, through the adapter for its kind of input (data/)
  4. the model: the user's, or a built-in one sized for the data (models.py)
  5. compiled as its user compiled it, the learning rate scaled, the optimizer wrapped in Horovod's
     DistributedOptimizer; the config resolved once (compiling.py, optimizer.py)
  6. rank 0's state to every rank: its checkpoint if there is one (checkpoint.py)
  7. model.fit, the ranks agreeing at every epoch's end (callbacks.py): a fixed set of workers
     (`fit_fixed`), or Horovod's elastic rounds (`fit_elastic`)
  8. the summary, gathered from every rank; rank 0 writes it with the model (summary.py)

`python -m hvdtrain` is `run(config.load(argv))`; `hvdtrain.fit(model, data, ...)` is `run` with the
user's objects. A failed step is explained by failures.py, a hung rank by watchdog.py, a scheduler's
SIGTERM handled by preemption.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import socket
import sys
import time

from . import callbacks as callbacks_lib
from . import compat, compiling, failures, models, optimizer, preemption, rundir, runtime, summary, watchdog
from . import config as config_lib
from . import data as data_lib
from .checkpoint import Checkpoints
from .compiling import Trainer
from .config import Config, Sharding, UserError
from .runtime import log


# ---------------------------------------------------------------- the Python API

def init(**config) -> runtime.World:
    """hvd.init(), pin this worker's GPU (or CPU threads), seed, precision: call it before building
    the model. Takes the same keys as hvdtrain.fit (threads, seed, precision, Horovod's knobs...)."""
    runtime.report_errors_once()
    cfg = config_lib.from_dict(config).validate(model_object=True, data_object=True)
    world = start(cfg)
    set_precision(cfg.precision)
    _LOOP["cfg"] = cfg
    return world


# ---------------------------------------------------------------- a loop of your own, in Horovod's steps

def DistributedOptimizer(opt, **config):  # noqa: N802 (named as Horovod's, which it stands for)
    """`opt` (a Keras optimizer) whose apply_gradients averages the gradients over the workers first:
    the same class and settings, as fit() trains with. For a loop of your own, after hvdtrain.init():

        opt = hvdtrain.DistributedOptimizer(keras.optimizers.Adam(1e-3 * world.size))
        ... grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))   # averaged, then applied

    config: the keys that shape the allreduce (compression, sparse_as_dense, allreduce_groups,
    reduction). Works on Keras 3, where Horovod's own DistributedGradientTape and Keras optimizer fail."""
    runtime.report_errors_once()
    cfg = config_lib.from_dict(config).validate(model_object=True, data_object=True)
    if cfg.backward_passes_per_step > 1:
        raise UserError("DistributedOptimizer: backward_passes_per_step is fit()'s; accumulate in your loop")
    _after_init("DistributedOptimizer")
    return optimizer.distributed(opt, cfg, loss_scale=False)


def broadcast(model, opt=None, root_rank: int = 0):
    """Every worker starts from rank 0's model weights and optimizer state (its slots built now, so
    the first step is already in step): call it once, after building both, before the first step."""
    runtime.report_errors_once()
    world = _after_init("broadcast")
    optimizer.broadcast_initial_state(model, opt, root_rank)
    _watch_the_loop(world)


_LOOP: dict = {}  # init()'s config, and the watch over a loop of one's own that broadcast() started


def _watch_the_loop(world: runtime.World):
    """From the first step of a loop of one's own, as in fit(): a rank that freezes, or ranks that
    wait in different collectives, are named in one line and every rank ends; a peer that dies is
    named by the survivors when their step fails (failures.report). The stuck bound is off unless
    init() was given hang_stuck_seconds: a loop may keep rank 0 alone busy (an evaluation, a save)
    while the others wait in the next allreduce."""
    cfg = _LOOP.get("cfg") or config_lib.Config()
    if cfg.hang_stuck_seconds is None:
        cfg = dataclasses.replace(cfg, hang_stuck_seconds=0)
    if _LOOP.get("watch") is not None:
        _LOOP["watch"].stop()
    watch = _LOOP["watch"] = watchdog.Watchdog(cfg, world, then="your script starts again from what it saved")
    runtime.on_uncaught(lambda e: _a_peer_failed(e, watch, world))


def _a_peer_failed(e, watch: watchdog.Watchdog, world: runtime.World) -> bool:
    """A loop's step that failed in Horovod's collective (a peer died, hung, or failed): named as
    fit() names it, in one line. Any other error is left to Python's traceback (False)."""
    if not failures.in_a_collective(e):
        return False
    watch.on_failure()  # a hung peer's silence explains it: the watchdog names it and exits
    try:
        failures.report(e, "a step of the loop", "", world, watch.workers)
    except runtime.TrainingFailed as said:
        print(f"hvdtrain: error: {said}", file=sys.stderr, flush=True)
    except SystemExit:  # the survivors' lines are written
        pass
    return True


def shard(dataset):
    """This worker's part of `dataset` (before batching): by file where it reads files and every
    worker gets one, else every size-th element, as fit() shards a pipeline."""
    world = _after_init("shard")
    return data_lib.shard(dataset, world.rank, world.size)[0]


def _after_init(what: str) -> runtime.World:
    world = runtime.world()
    if not world.device:  # set by hvdtrain.init()
        raise UserError(f"hvdtrain.{what}: call hvdtrain.init() first, before building the model")
    return world


@dataclasses.dataclass(frozen=True)
class Given:
    """What a script handed hvdtrain.fit, beside the config that only names it: its model, data,
    validation data and callbacks. None: the config's own (`python -m hvdtrain` gives none)."""
    model: object = None
    data: object = None
    validation: object = None
    callbacks: object = None


def fit(model, data, validation_data=None, callbacks=None, validation_split=0.0, **config) -> dict:
    """Train `model` on `data` across the job's workers, as `python -m hvdtrain` would; returns the
    summary (rank 0 also writes it, with the model and checkpoints, under output_dir).

    model: a tf.keras.Model (compiled or not), or a model name / module:function.
    data: a tf.data.Dataset, a function returning one (taking a DataContext, it shards itself), a
        (train, val) pair of them, (x, y) arrays, or a --data string.
    callbacks: Keras callbacks, as model.fit takes them: they see the metrics of all workers; the
        ones that write files run on rank 0 (hvdtrain.on_rank0 marks your own); a change they make to
        the learning rate trains.
    validation_split: as Keras' fit takes it, for (x, y) arrays: the last fraction held out, before
        any shuffling (validation_data, if given, is used instead, as in Keras).
    config: any of `python -m hvdtrain --help`'s fields (epochs=5, batch_size=64, output_dir=...).
    """
    runtime.report_errors_once()
    for key in ("model", "data", "config"):
        if key in config:
            raise UserError(f"hvdtrain.fit: pass {key} positionally, not as a config key")
    if validation_split and validation_data is None:
        data, validation_data = data_lib.last_fraction(data, validation_split)
    model_object, data_object = not isinstance(model, str), not isinstance(data, str)
    if isinstance(callbacks, str):  # "module:function", as --callbacks takes it
        config["callbacks"], callbacks = callbacks, None
    cfg = config_lib.from_dict({**config, "model": _label(model), "data": _label(data)}).validate(
        model_object=model_object, data_object=data_object)
    cfg, notes = rundir.own_dir_per_fit(cfg)
    given = Given(model if model_object else None, data if data_object else None, validation_data, callbacks)
    return run(cfg, given, notes)


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


# ---------------------------------------------------------------- the recipe

def start(cfg: Config) -> runtime.World:
    """Step 1, everything before a model is built: hvd.init, pinning, seed (the precision: set_precision)."""
    import tensorflow as tf

    world = runtime.init(cfg.threads, cfg.horovod_env())
    tf.keras.utils.set_random_seed(cfg.seed)
    if cfg.deterministic:
        tf.config.experimental.enable_op_determinism()
    return world


_FIT_SET: list = []  # (the policy a fit()'s --precision set, the one before it): for that fit() alone


def set_precision(asked: str | None, for_one_fit: bool = False) -> str:
    """The Keras global policy to train in: the one the script set (Keras' mixed-precision guide sets
    it at the top, before hvdtrain.init()) is kept; --precision sets one where the script set none,
    and is refused where the script set another. A fit()'s own --precision holds for that fit (as
    for `python -m hvdtrain`); init()'s, as the script's own. Returns the policy's name."""
    import tensorflow as tf

    now = tf.keras.mixed_precision.global_policy().name
    if _FIT_SET and _FIT_SET[-1][0] == now:  # a former fit()'s own: the script's comes back
        now = _FIT_SET.pop()[1]
        tf.keras.mixed_precision.set_global_policy(now)
    if asked is None or asked == now:
        return now
    if now != "float32":
        raise UserError(f"--precision {asked}: the script set Keras' global policy {now} "
                        f"(keras.mixed_precision.set_global_policy); drop the flag, or set the policy you want")
    tf.keras.mixed_precision.set_global_policy(asked)
    if for_one_fit:
        _FIT_SET.append((asked, now))
    return asked


def run(cfg: Config, given: Given = Given(), notes=()) -> dict:
    """The recipe's steps in order (this module's docstring). Set-up errors are agreed on: every rank
    raises the same one-line error rather than leave the others waiting in a collective."""
    timeline = summary.Timeline(launched=time.time())
    elastic = runtime.launched_elastic()
    if cfg.elastic and not elastic:
        raise UserError("--elastic needs an elastic launch: horovodrun -np N --min-np MIN --max-np MAX "
                        "--host-discovery-script SCRIPT python -m hvdtrain ... (see docs/reliability.md)")
    callbacks = callbacks_lib.users(given.callbacks, cfg)
    # 1. hvd.init; pin this worker's device; seed; precision
    world = start(cfg)
    cfg = dataclasses.replace(cfg, precision=set_precision(cfg.precision, for_one_fit=True))
    # from here on, a scheduler's SIGTERM stops every rank at one step, after a checkpoint (preemption.py)
    with preemption.handling(() if elastic else cfg.preemption_signals):
        _introduce(cfg, world)
        # An elastic worker can join a running job alone: until hvd.elastic.run has synced it with the
        # others it must not call a collective, so its set-up is its own (runtime.alone)
        with runtime.alone() if elastic else contextlib.nullcontext():
            # 2. a run already trained to its last epoch is left as it is
            done = None if elastic else runtime.all_ranks_agree(rundir.finished_run, cfg)
            if done is not None and given.model is None:
                rundir.say_finished(cfg, done, "nothing to do")
                return done
            # 3. this worker's shard (elastic: for the model's shapes; every round shards anew)
            data = runtime.all_ranks_agree(load_data, cfg, world, given)
            # 4. the model
            model = given.model if given.model is not None else runtime.all_ranks_agree(models.build, cfg.model, data)
            # 5. compiled with the distributed optimizer; the config resolved (batch size, learning rate)
            cfg, trainer = runtime.all_ranks_agree(compiling.compile_for_training, model, cfg, world, data,
                                                   callbacks)
        for note in [*notes, *([] if elastic else data.notes), *trainer.notes]:
            log.info(note)
        _say_if_step_checkpoints_cannot_resume(cfg, data)
        ckpts = Checkpoints(cfg, model)
        if done is not None:  # a finished fit() of a script run again: its model leaves as it was trained
            ckpts.restore_and_broadcast()
            rundir.say_finished(cfg, done, "its final weights and optimizer state are back in the model")
            return done
        timeline.startup_s = time.time() - timeline.launched
        # 6. rank 0's state to every rank, and 7. model.fit
        try:
            if elastic:
                history, epoch_end, data = fit_elastic(cfg, model, given, ckpts, trainer, timeline)
            else:
                history, epoch_end = fit_fixed(cfg, model, data, world, ckpts, trainer, timeline)
        except optimizer.NonFiniteUpdate as e:
            raise UserError(str(e)) from None
        except preemption.Preempted as e:
            log.info("%s", e, extra=runtime.FILE_ONLY)
            raise
        # 8. the summary, every rank's figures gathered; rank 0 writes it, and the model
        return summary.finish(cfg, model, data, trainer, ckpts, history, epoch_end, timeline)


def _introduce(cfg: Config, world: runtime.World):
    """This worker's log file, and a line from every worker: its rank, host, pid and device."""
    runtime.setup_logging(os.path.join(cfg.run_dir, "logs", f"rank{world.rank}.log")
                          if cfg.worker_logs else None)
    log.info("rank %d/%d (local %d/%d) on %s, pid %d: %s; %s", world.rank, world.size, world.local_rank,
             world.local_size, socket.gethostname(), os.getpid(), world.device, world.cycle,
             extra=runtime.EVERY_RANK)
    _warn_if_stall_check_is_blind(cfg, world)


def load_data(cfg: Config, world: runtime.World, given: Given = Given()) -> data_lib.Data:
    """Step 3: this worker's shard, in whole updates (a multiple of backward_passes_per_step steps)."""
    need_classes = models.needs_classes(cfg.model) if given.model is None and cfg.num_classes is None else None
    data = data_lib.load(cfg, world, given.data, given.validation, need_classes)
    if cfg.num_classes is not None:
        data.num_classes = cfg.num_classes
    data.steps_per_epoch -= data.steps_per_epoch % cfg.backward_passes_per_step
    if data.steps_per_epoch == 0:
        raise UserError(f"--backward-passes-per-step {cfg.backward_passes_per_step} is more than the "
                        f"steps in an epoch; lower it or --batch-size")
    return data


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


# ---------------------------------------------------------------- 6 and 7: model.fit

def keras_callbacks(cfg: Config, data: data_lib.Data, world: runtime.World, trainer: Trainer, saver,
                    epoch_end, progress, extra=()):
    """hvdtrain's agreement at epoch end first: every callback after it (the user's, early stopping,
    best model, TensorBoard, checkpoints, progress) sees metrics combined over all workers, so every
    rank takes the same decisions."""
    import tensorflow as tf

    cbs = [epoch_end]
    if trainer.callbacks:
        if trainer.learning_rate is not None:
            before, after = callbacks_lib.following_the_learning_rate(trainer.learning_rate,
                                                                      bool(trainer.per_batch))
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
    if world.size > 1:
        cbs.append(callbacks_lib.agree_to_stop())
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
    sharded = {Sharding.YOURS: "sharded by the data function", Sharding.NONE: "one worker: not sharded"}.get(
        data.sharding, f"sharded by {data.sharding}")
    log.info("%s on %s%s, %s: %d steps/epoch of %d per worker, %d workers, epochs %d..%d%s", model.name,
             cfg.data, f" ({data.num_samples} samples)" if data.num_samples else "", sharded,
             data.steps_per_epoch, data.batch_size, world.size, first_epoch + 1, cfg.epochs,
             f" (from step {first_step + 1})" if first_step else "")
    import tensorflow as tf

    epoch_end, progress = callbacks_lib.make(cfg, data, world.size, world.is_chief)
    saver = callbacks_lib.checkpoints(cfg, ckpts, data.steps_per_epoch, first_epoch, first_step,
                                      trainer.steps_per_execution)
    if world.size > 1 and not optimizer.compiled_trains(model):  # optimizers of the model's own
        extra_callbacks = [callbacks_lib.first_steps_agree(), *extra_callbacks]
    callbacks = keras_callbacks(cfg, data, world, trainer, saver, epoch_end, progress, extra_callbacks)
    if cfg.preemption_signals and not cfg.elastic and preemption.usable(world):
        callbacks.append(preemption.watcher(ckpts, data.steps_per_epoch, first_epoch, first_step))
    iteration = int(optimizer.steps(model).numpy()) - first_step  # at the start of first_epoch
    for rate in trainer.rates.values():
        rate.start(optimizer.lr_multiplier(cfg, world), first_epoch, iteration, data.steps_per_epoch, world.size)
    parts, class_weight = [], cfg.class_weights()
    try:
        if first_step:  # the rest of a resumed epoch: Keras' epochs all have one length
            ds, steps, feeding = data.feed(first_epoch, skip=first_step)
            parts.append(model.fit(ds, epochs=first_epoch + 1, initial_epoch=first_epoch, steps_per_epoch=steps,
                                   class_weight=class_weight, callbacks=[*feeding, *callbacks], verbose=0,
                                   shuffle=False))  # the data are shuffled already (Keras 3 warns)
        start = first_epoch + len(parts)
        if start < cfg.epochs and not (parts and model.stop_training):
            ds, steps, feeding = data.feed(start)
            parts.append(model.fit(ds, epochs=cfg.epochs, initial_epoch=start, steps_per_epoch=steps,
                                   class_weight=class_weight, callbacks=[*feeding, *callbacks], verbose=0,
                                   shuffle=False))
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


def fit_fixed(cfg: Config, model, data, world: runtime.World, ckpts, trainer: Trainer,
              timeline: summary.Timeline):
    """A fixed set of workers: rank 0's checkpoint (if any) restored and its state broadcast to every
    rank, then model.fit from where it stopped. Returns (history, the EpochEnd callback).

    If a step fails, its rank names the cause in one line; if a worker dies, the survivors name every
    worker so the dead one can be found; if one hangs, the watchdog names it and ends the job."""
    t = time.time()
    first_epoch, first_step = ckpts.restore_and_broadcast()
    timeline.broadcast_s, timeline.started_at = time.time() - t, time.time()
    _say_how_it_resumes(cfg, ckpts, world, model)
    first_step = replayable_step(cfg, data, first_epoch, first_step)
    timeline.first_epoch, timeline.first_step = first_epoch, first_step
    dog = watchdog.Watchdog(cfg, world, resume_point=lambda: ckpts.last_saved,
                            facts={"steps per call": trainer.steps_per_execution})
    iteration = int(optimizer.steps(model).numpy()) - first_step
    try:
        return fit_on_shard(cfg, model, data, world, ckpts, first_epoch, trainer, first_step=first_step)
    except (optimizer.NonFiniteUpdate, UserError, KeyboardInterrupt, preemption.Preempted):
        raise
    except Exception as e:  # noqa: BLE001 (any failed step is explained in one line, then raised)
        dog.on_failure()  # a hung peer's silence explains it: the watchdog names it
        failed = optimizer.failed_step(e)  # the step a check of TrainStep names, else Keras' count
        done = (failed if failed is not None else int(optimizer.steps(model).numpy())) - iteration
        after = getattr(e, "hvdtrain_validating_after_epoch", None)  # set by callbacks.EpochEnd
        what, where = ("validation", f"after epoch {after}") if after else (
            "the training step",
            f"at epoch {first_epoch + done // data.steps_per_epoch + 1}, step {done % data.steps_per_epoch + 1}")
        failures.report(e, what, where, world, dog.workers)  # dog.workers: every rank's (host, pid)
    finally:
        dog.stop()


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


def fit_elastic(cfg: Config, model, given: Given, ckpts, trainer: Trainer, timeline: summary.Timeline):
    """Training that outlives its workers, with Horovod's elastic API.

    hvd.elastic.run calls `one_round` again after every change of the world: when a worker dies, the
    survivors roll back to the last commit; when hosts join, everyone goes on from the current state
    (`commit_every` steps). Each round starts by syncing rank 0's state to all, then re-shards the data
    and rescales the learning rate for the workers it has. Returns (history, the EpochEnd callback, the
    last round's data).
    """
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf
    from horovod.common.exceptions import HorovodInternalError

    ckpts.restore_on_rank0()  # the first sync hands rank 0's model, optimizer and epoch to everyone
    saved = (ckpts.resumed_from or {}).get("world_size")
    # a step checkpoint's position (and per-rank state) holds for the number of workers that wrote it
    state = compat.elastic_state(model, epoch=int(ckpts.epoch.numpy()), batch=int(ckpts.step.numpy()),
                                   batch_world=saved or 0, ranks=ckpts.ranks)
    rounds, data, sharded_for = timeline.rounds, None, None

    @hvd.elastic.run
    def one_round(state):
        nonlocal data, sharded_for
        world = runtime.refresh()
        if sharded_for is None or (world.rank, world.size) != (sharded_for.rank, sharded_for.size):
            data, sharded_for = load_data(cfg, world, given), world
            for note in data.notes:
                log.info(note)
        lr = trainer.peak_lr(cfg, world)
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

    history, epoch_end = one_round(state)
    timeline.first_epoch, timeline.first_step = rounds[0]["from_epoch"], rounds[0]["from_step"]
    return history, epoch_end, data
