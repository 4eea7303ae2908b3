"""The training path: config -> hvd.init and device pinning -> shard -> model -> model.fit -> summary.

This is the Horovod recipe for Keras, in order: pin one device per worker, scale the learning rate by
the number of workers (with a warm-up, Goyal et al. 2017), wrap the optimizer in
hvd.DistributedOptimizer, start every rank from rank 0's variables, average metrics, and let rank 0
alone print and write.
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import time

from . import data as data_lib
from . import models, runtime
from .config import Config
from .runtime import log, rank0_only


def make_optimizer(cfg: Config, size: int):
    """The user's optimizer at lr x workers: the linear scaling rule for a global batch that grew as much."""
    import tensorflow as tf

    lr = cfg.lr * size
    return {
        "sgd": lambda: tf.keras.optimizers.SGD(lr),
        "momentum": lambda: tf.keras.optimizers.SGD(lr, momentum=0.9),
        "adam": lambda: tf.keras.optimizers.Adam(lr),
        "rmsprop": lambda: tf.keras.optimizers.RMSprop(lr),
    }[cfg.optimizer]()


def broadcast_initial_state(model, root_rank: int = 0):
    """Give every rank rank 0's weights and optimizer slots before the first step.

    Horovod's BroadcastGlobalVariablesCallback broadcasts after the first batch, so that first update
    would start from different weights on each rank; building the optimizer first lets us broadcast
    everything up front, and the first step is already synchronous.
    """
    import horovod.tensorflow as hvd

    model.optimizer.build(model.trainable_variables)
    if hvd.size() > 1:
        hvd.broadcast_variables(model.variables, root_rank=root_rank)
        hvd.broadcast_variables(model.optimizer.variables, root_rank=root_rank)


def weights_sha256(model) -> str:
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(w.tobytes())
    return h.hexdigest()


def _throughput_callback(batch_size: int):
    """Samples/s of this worker from the end of the first step (graph tracing excluded) to the end."""
    import tensorflow as tf

    class Throughput(tf.keras.callbacks.Callback):
        start, steps, wall = None, 0, 0.0

        def on_train_batch_end(self, batch, logs=None):
            if self.start is None:
                self.start = time.perf_counter()
            else:
                self.steps += 1

        def on_train_end(self, logs=None):
            if self.start is not None:
                self.wall = time.perf_counter() - self.start

        @property
        def samples_per_sec(self) -> float:
            return self.steps * batch_size / self.wall if self.wall > 0 else 0.0

    return Throughput()


def callbacks(cfg: Config, data: data_lib.Data, world: runtime.World):
    """Horovod's callbacks first (metric averaging must precede anything that reads metrics)."""
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    cbs = [hvd.callbacks.MetricAverageCallback()]
    if cfg.warmup_epochs > 0 and world.size > 1:
        cbs.append(hvd.callbacks.LearningRateWarmupCallback(
            initial_lr=cfg.lr * world.size, warmup_epochs=cfg.warmup_epochs,
            steps_per_epoch=data.steps_per_epoch, verbose=0))
    if world.is_chief and cfg.tensorboard:
        cbs.append(tf.keras.callbacks.TensorBoard(os.path.join(cfg.run_dir, "tensorboard"),
                                                  profile_batch=0))
    return cbs


def run(cfg: Config) -> dict:
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    t0 = time.time()
    world = runtime.init(cfg.threads)
    runtime.setup_logging(os.path.join(cfg.run_dir, "logs", f"rank{world.rank}.log")
                          if cfg.worker_logs else None)
    host = socket.gethostname()
    log.info("rank %d/%d (local %d/%d) on %s: %s", world.rank, world.size, world.local_rank,
             world.local_size, host, world.device, extra=runtime.EVERY_RANK)
    tf.keras.utils.set_random_seed(cfg.seed)

    data = runtime.all_ranks_agree(data_lib.load, cfg, world)
    model = runtime.all_ranks_agree(models.build, cfg.model, data.input_shape, data.num_classes)
    model.compile(optimizer=hvd.DistributedOptimizer(make_optimizer(cfg, world.size)),
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    broadcast_initial_state(model)
    log.info("%s on %s: %d samples, %s sharding, %d steps/epoch of %d per worker, %d workers",
             model.name, cfg.data, data.num_samples, data.sharding, data.steps_per_epoch,
             cfg.batch_size, world.size)

    throughput = _throughput_callback(cfg.batch_size)
    history = model.fit(data.stream(0, cfg.epochs), epochs=cfg.epochs,
                        steps_per_epoch=data.steps_per_epoch, validation_data=data.val,
                        callbacks=callbacks(cfg, data, world) + [throughput],
                        verbose=cfg.verbose if world.is_chief else 0)

    per_worker = _gather(throughput.samples_per_sec, world)
    summary = {
        "world_size": world.size,
        "hosts": sorted(set(_gather(host, world))),
        "epochs": cfg.epochs,
        "steps_per_epoch": data.steps_per_epoch,
        "global_batch_size": cfg.batch_size * world.size,
        "metrics": {k: float(v[-1]) for k, v in history.history.items()},
        "samples_per_sec_per_worker": per_worker,
        "samples_per_sec_total": sum(per_worker),
        "wall_time_s": time.time() - t0,
        "weights_sha256_by_rank": _gather(weights_sha256(model), world),
        "config": cfg.to_dict(),
    }
    _write_outputs(cfg, model, summary)
    log.info("done: %s", json.dumps(summary["metrics"]))
    return summary


def export_model(model, path: str):
    """Save architecture and weights without the compile state: the optimizer is Horovod's wrapper,
    and a model file should load with plain `tf.keras.models.load_model`, no Horovod needed."""
    import tensorflow as tf

    plain = tf.keras.models.clone_model(model)
    plain.set_weights(model.get_weights())
    plain.save(path)


def _gather(value, world):
    if world.size == 1:
        return [value]
    import horovod.tensorflow as hvd

    return hvd.allgather_object(value)


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
