"""The training path: config -> hvd.init and device pinning -> shard -> model -> model.fit -> summary.

This is the Horovod recipe for Keras, in order: pin one device per worker, scale the learning rate by
the number of workers (with a warm-up, Goyal et al. 2017), wrap the optimizer in
hvd.DistributedOptimizer, start every rank from rank 0's variables, average metrics, and let rank 0
alone print and write.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import time

from . import data as data_lib
from . import models, runtime
from .checkpoint import Checkpoints
from .config import Config, UserError
from .runtime import log, rank0_only


def lr_multiplier(cfg: Config, world: runtime.World) -> float:
    """The linear scaling rule: the global batch grew by workers x passes, so does the learning rate.

    Adasum combines gradients instead of averaging them and wants no such scaling on CPUs (on GPUs,
    with NCCL inside a host, by the local size), as Horovod's Adasum guide says.
    """
    if cfg.reduction == "adasum":
        return float(world.local_size if world.device.startswith("GPU") else 1) * cfg.backward_passes_per_step
    return float(world.size * cfg.backward_passes_per_step)


def make_optimizer(cfg: Config, world: runtime.World):
    """The user's optimizer at the scaled lr, wrapped in Horovod's DistributedOptimizer.

    Clipping (global_clipnorm) happens inside apply_gradients, i.e. on the allreduced gradient, so every
    rank clips the same vector.
    """
    import horovod.tensorflow as hvd_ops
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    lr = cfg.lr * lr_multiplier(cfg, world)
    kw = {"global_clipnorm": cfg.clip_norm} if cfg.clip_norm else {}
    opt = {
        "sgd": lambda: tf.keras.optimizers.SGD(lr, **kw),
        "momentum": lambda: tf.keras.optimizers.SGD(lr, momentum=0.9, **kw),
        "adam": lambda: tf.keras.optimizers.Adam(lr, **kw),
        "rmsprop": lambda: tf.keras.optimizers.RMSprop(lr, **kw),
    }[cfg.optimizer]()
    if cfg.reduction == "adasum":
        return opt  # Horovod's Keras optimizer wrapper takes Average or Sum only: see use_adasum()
    return hvd.DistributedOptimizer(
        opt,
        compression=_compression(cfg),
        op=hvd_ops.Average,
        backward_passes_per_step=cfg.backward_passes_per_step,
        average_aggregated_gradients=True,
        sparse_as_dense=cfg.sparse_as_dense)


def _compression(cfg: Config):
    import horovod.tensorflow as hvd

    return hvd.Compression.fp16 if cfg.compression == "fp16" else hvd.Compression.none


def use_adasum(model, cfg: Config, world: runtime.World):
    """Adasum through Horovod's DistributedGradientTape, in the model's own train_step.

    Horovod 0.28.1's Keras DistributedOptimizer rejects op=Adasum; its DistributedGradientTape does not.
    """
    import types

    import horovod.tensorflow as hvd
    import tensorflow as tf

    if world.size & (world.size - 1):
        raise UserError(f"--reduction adasum needs a power-of-2 number of workers, got {world.size}")
    if world.size > 1 and not hvd.mpi_enabled():
        raise UserError("--reduction adasum needs the MPI controller (horovodrun --mpi, or mpirun)")
    if cfg.backward_passes_per_step > 1 or cfg.precision == "mixed_float16":
        raise UserError("--reduction adasum does not combine with --backward-passes-per-step > 1 "
                        "or --precision mixed_float16")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x, y, y_pred)
        tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum, compression=_compression(cfg),
                                           sparse_as_dense=cfg.sparse_as_dense)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return self.compute_metrics(x, y, y_pred, None)

    model.train_step = types.MethodType(train_step, model)


def build_optimizer(model):
    """Create the optimizer's slots now (Keras creates them at the first step), so that a checkpoint
    can be restored into them and they can be broadcast before training starts."""
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)  # under a LossScaleOptimizer
    optimizer.build(model.trainable_variables)


def broadcast_initial_state(model, root_rank: int = 0):
    """Give every rank rank 0's weights and optimizer slots before the first step.

    Horovod's BroadcastGlobalVariablesCallback broadcasts after the first batch, so that first update
    would start from different weights on each rank; building the optimizer first lets us broadcast
    everything up front, and the first step is already synchronous.
    """
    import horovod.tensorflow as hvd

    build_optimizer(model)
    if hvd.size() > 1:
        hvd.broadcast_variables(model.variables, root_rank=root_rank)
        hvd.broadcast_variables(model.optimizer.variables, root_rank=root_rank)


def weights_sha256(model) -> str:
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(w.tobytes())
    return h.hexdigest()


def _throughput_callback(batch_size: int):
    """Samples/s of this worker over training steps only: validation and the first step (graph
    tracing) are left out."""
    import tensorflow as tf

    class Throughput(tf.keras.callbacks.Callback):
        steps, busy = 0, 0.0
        started = last_end = None

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0 and self.last_end is not None:  # a new epoch: restart the clock
                self.started = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            now = time.perf_counter()
            if self.started is None:  # the first step of the run: tracing, not training
                self.started = now
            else:
                self.steps += 1
                self.busy += now - (self.last_end if self.last_end and batch else self.started)
            self.last_end = now

        @property
        def samples_per_sec(self) -> float:
            return self.steps * batch_size / self.busy if self.busy > 0 else 0.0

    return Throughput()


def _stop_on_nonfinite_loss():
    """Keras' TerminateOnNaN decides per rank; a rank that stops alone leaves the others waiting in
    the next allreduce. Here the ranks agree every step (one scalar allreduce) and stop together."""
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    class StopOnNonFiniteLoss(tf.keras.callbacks.Callback):
        where = None

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            bad = float(not np.isfinite(logs.get("loss", 0.0)))
            if hvd.size() > 1:
                bad = float(hvd.allreduce(tf.constant(bad), op=hvd.Sum, name="hvdtrain.nonfinite_loss"))
            if bad:
                self.where = (self.epoch + 1, batch + 1)
                self.model.stop_training = True

    return StopOnNonFiniteLoss()


def _lr_callbacks(cfg: Config, data: data_lib.Data, world: runtime.World):
    """Warm-up from lr to lr x workers (Goyal et al. 2017), then the schedule, all in epochs."""
    import horovod.tensorflow.keras as hvd

    peak = cfg.lr * lr_multiplier(cfg, world)
    steps = data.steps_per_epoch
    cbs = []
    if cfg.warmup_epochs > 0 and lr_multiplier(cfg, world) > 1:
        cbs.append(hvd.callbacks.LearningRateWarmupCallback(
            initial_lr=peak, warmup_epochs=cfg.warmup_epochs, steps_per_epoch=steps,
            momentum_correction=False, verbose=0))
    start = cfg.warmup_epochs
    if cfg.lr_schedule == "cosine":
        span = max(cfg.epochs - start, 1e-9)
        cbs.append(hvd.callbacks.LearningRateScheduleCallback(
            initial_lr=peak, start_epoch=start, end_epoch=cfg.epochs, staircase=False,
            steps_per_epoch=steps, momentum_correction=False,
            multiplier=lambda e: 0.5 * (1 + math.cos(math.pi * (e - start) / span))))
    elif cfg.lr_schedule == "step":
        cbs.append(hvd.callbacks.LearningRateScheduleCallback(
            initial_lr=peak, start_epoch=start, end_epoch=cfg.epochs, staircase=True,
            momentum_correction=False,
            multiplier=lambda e: cfg.lr_decay_factor ** sum(e >= m for m in cfg.lr_decay_epochs)))
    return cbs


def callbacks(cfg: Config, data: data_lib.Data, world: runtime.World, ckpts):
    """Horovod's metric averaging first: everything after it (early stopping, best model,
    TensorBoard) sees metrics averaged over all workers, so every rank takes the same decisions."""
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    cbs = [hvd.callbacks.MetricAverageCallback(), *_lr_callbacks(cfg, data, world)]
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
    if cfg.checkpoint_every:
        cbs.append(ckpts.callback())
    return cbs


def run(cfg: Config) -> dict:
    import tensorflow as tf

    t0 = time.time()
    elastic = runtime.launched_elastic()
    if cfg.elastic and not elastic:
        raise UserError("--elastic needs an elastic launch: horovodrun -np N --min-np MIN --max-np MAX "
                        "--host-discovery-script SCRIPT python -m hvdtrain ... (see docs/reliability.md)")
    world = runtime.init(cfg.threads, cfg.horovod_env())
    runtime.setup_logging(os.path.join(cfg.run_dir, "logs", f"rank{world.rank}.log")
                          if cfg.worker_logs else None)
    host = socket.gethostname()
    log.info("rank %d/%d (local %d/%d) on %s, pid %d: %s", world.rank, world.size, world.local_rank,
             world.local_size, host, os.getpid(), world.device, extra=runtime.EVERY_RANK)
    _warn_if_stall_check_is_blind(cfg, world)
    tf.keras.utils.set_random_seed(cfg.seed)
    if cfg.deterministic:
        tf.config.experimental.enable_op_determinism()
    tf.keras.mixed_precision.set_global_policy(cfg.precision)

    # An elastic worker can join a running job alone: until hvd.elastic.run has synced it with the
    # others, it must not call a collective, so set-up errors are not agreed on there.
    agree = (lambda fn, *args: fn(*args)) if elastic else runtime.all_ranks_agree
    data = agree(load_data, cfg, world)
    model = agree(models.build, cfg.model, data.input_shape, data.num_classes)
    model.compile(optimizer=make_optimizer(cfg, world),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    if cfg.reduction == "adasum":
        agree(use_adasum, model, cfg, world)
    ckpts = Checkpoints(cfg, model)
    if elastic:
        (history, throughput, nonfinite), data, rounds = fit_elastic(cfg, model, data, ckpts)
        first_epoch = rounds[0]["from_epoch"]
    else:
        first_epoch, rounds = ckpts.restore_and_broadcast(), []
        history, throughput, nonfinite = fit_fixed(cfg, model, data, world, ckpts, first_epoch)
    if nonfinite.where:
        epoch, step = nonfinite.where
        raise UserError(f"the loss became NaN or infinite at epoch {epoch}, step {step}, on at least one "
                        f"worker; every worker stopped there. Lower --lr, add --clip-norm, or check the "
                        f"data for NaN/Inf")

    world = runtime.world()
    per_worker = runtime.gather(throughput.samples_per_sec)
    summary = {
        "world_size": world.size,
        "hosts": sorted(set(runtime.gather(host))),
        "epochs": cfg.epochs,
        "first_epoch": first_epoch,
        "epochs_run": len(history.epoch),
        "steps_per_epoch": data.steps_per_epoch,
        "global_batch_size": cfg.batch_size * world.size * cfg.backward_passes_per_step,
        "metrics": {k: float(v[-1]) for k, v in history.history.items()},
        "samples_per_sec_per_worker": per_worker,
        "samples_per_sec_total": sum(per_worker),
        "wall_time_s": time.time() - t0,
        "weights_sha256_by_rank": runtime.gather(weights_sha256(model)),
        "precision": {"policy": tf.keras.mixed_precision.global_policy().name,
                      "loss_scaling": isinstance(model.optimizer, tf.keras.mixed_precision.LossScaleOptimizer)},
        "elastic_rounds": rounds,
        "runtime_env": runtime.applied_defaults(),
        "config": cfg.to_dict(),
    }
    _write_outputs(cfg, model, summary)
    log.info("done: %s", json.dumps(summary["metrics"]))
    return summary


def _warn_if_stall_check_is_blind(cfg: Config, world: runtime.World):
    """Horovod 0.28.1's stall check reports only under the MPI controller: under Gloo, rank 0's
    background loop waits in its per-cycle gather for the stalled rank and never gets to the check
    (measured, docs/reliability.md). Say so rather than let a user wait for a warning that never comes."""
    import horovod.tensorflow as hvd

    if (cfg.stall_check_seconds or cfg.stall_shutdown_seconds) and world.size > 1 and not hvd.mpi_enabled():
        log.warning("--stall-check-seconds/--stall-shutdown-seconds: Horovod's stall check does not "
                    "report under the Gloo controller; launch with horovodrun --mpi or mpirun for it")


def load_data(cfg: Config, world: runtime.World) -> data_lib.Data:
    """This worker's shard, in whole updates (a multiple of backward_passes_per_step steps)."""
    data = data_lib.load(cfg, world)
    data.steps_per_epoch -= data.steps_per_epoch % cfg.backward_passes_per_step
    if data.steps_per_epoch == 0:
        raise UserError(f"--backward-passes-per-step {cfg.backward_passes_per_step} is more than the "
                        f"steps in an epoch; lower it or --batch-size")
    return data


def fit(cfg: Config, model, data: data_lib.Data, world: runtime.World, ckpts, first_epoch: int,
        extra_callbacks=()):
    """model.fit over this worker's shard from first_epoch; returns (history, throughput, nonfinite)."""
    log.info("%s on %s: %d samples, %s sharding, %d steps/epoch of %d per worker, %d workers, "
             "epochs %d..%d", model.name, cfg.data, data.num_samples, data.sharding,
             data.steps_per_epoch, cfg.batch_size, world.size, first_epoch + 1, cfg.epochs)
    throughput, nonfinite = _throughput_callback(cfg.batch_size), _stop_on_nonfinite_loss()
    history = model.fit(data.stream(first_epoch, cfg.epochs), epochs=cfg.epochs,
                        initial_epoch=first_epoch, steps_per_epoch=data.steps_per_epoch,
                        validation_data=data.val,
                        callbacks=[nonfinite, *extra_callbacks, *callbacks(cfg, data, world, ckpts),
                                   throughput],
                        verbose=cfg.verbose if world.is_chief else 0)
    return history, throughput, nonfinite


def fit_fixed(cfg: Config, model, data, world: runtime.World, ckpts, first_epoch: int):
    """A fixed set of workers: if one dies, the job ends, naming every worker so the dead one can be found."""
    workers = runtime.gather((socket.gethostname(), os.getpid()))
    try:
        return fit(cfg, model, data, world, ckpts, first_epoch)
    except Exception as e:
        if world.size == 1 or "horovod" not in f"{type(e).__module__} {e}".lower():
            raise
        table = ", ".join(f"rank {r} on {h} (pid {p})" for r, (h, p) in enumerate(workers))
        log.error("rank %d lost its peers during training (%s: %s), or Horovod shut down. Workers "
                  "were: %s. The launcher names the one that exited first; a stall shutdown is "
                  "reported above by Horovod.", world.rank, type(e).__name__,
                  str(e).strip().splitlines()[0][:200], table, extra=runtime.EVERY_RANK)
        raise SystemExit(1) from None


def fit_elastic(cfg: Config, model, data, ckpts):
    """Training that outlives its workers, with Horovod's elastic API.

    hvd.elastic.run calls `one_round` again after every change of the world: when a worker dies, the
    survivors roll back to the last commit; when hosts join, everyone goes on from the current state
    (`commit_every` steps). Each round starts by syncing rank 0's state to all, then re-shards the data
    and rescales the learning rate for the workers it has. Returns (fit's result, data, rounds).
    """
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    ckpts.restore_on_rank0()  # the first sync hands rank 0's model, optimizer and epoch to everyone
    state = hvd.elastic.KerasState(model, epoch=int(ckpts.epoch.numpy()), batch=0)
    rounds, sharded_for = [], runtime.world()

    @hvd.elastic.run
    def one_round(state):
        nonlocal data, sharded_for
        world = runtime.refresh()
        if (world.rank, world.size) != (sharded_for.rank, sharded_for.size):
            data, sharded_for = load_data(cfg, world), world
        lr = cfg.lr * lr_multiplier(cfg, world)
        model.optimizer.learning_rate.assign(lr)
        rounds.append({"world_size": world.size, "from_epoch": int(state.epoch), "lr": lr})
        log.info("elastic round %d: %d workers from epoch %d, lr %g", len(rounds), world.size,
                 state.epoch + 1, lr)
        keep_state = [
            hvd.elastic.UpdateBatchStateCallback(state),
            # Horovod's UpdateEpochStateCallback counts from a fit() that starts at epoch 0; ours passes
            # initial_epoch so schedules and checkpoints see the true epoch, so the epoch is stored as is.
            tf.keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: setattr(state, "epoch", epoch + 1)),
            hvd.elastic.CommitStateCallback(state, batches_per_commit=cfg.commit_every),
        ]
        return fit(cfg, model, data, world, ckpts, int(state.epoch), keep_state)

    return one_round(state), data, rounds


def export_model(model, path: str):
    """Save architecture and weights without the compile state: the optimizer is Horovod's wrapper,
    and a model file should load with plain `tf.keras.models.load_model`, no Horovod needed."""
    import tensorflow as tf

    plain = tf.keras.models.clone_model(model)
    plain.set_weights(model.get_weights())
    plain.save(path)


@rank0_only
def _write_outputs(cfg: Config, model, summary: dict):
    os.makedirs(cfg.run_dir, exist_ok=True)
    if cfg.save_model:
        export_model(model, os.path.join(cfg.run_dir, "model.keras"))
    path = os.path.join(cfg.run_dir, "summary.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(summary, fh, indent=2)
    os.replace(path + ".tmp", path)
    runtime.say(f"hvdtrain: wrote {path}")
