"""Step 8 of the recipe: what a run reports and leaves. Every rank's figures are gathered into one
summary (throughput, timings, every rank's weights' digest, the config); rank 0 writes it to
summary.json, with the model as plain Keras loads it (model.keras). The bench and the tests read the
summary by key: its keys are kept."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import time

from . import compat, failures, optimizer, rundir, runtime
from .config import Config
from .runtime import log, rank0_only


@dataclasses.dataclass
class Timeline:
    """Where and when training started: set by the fit loops, read by the summary."""
    launched: float  # time.time() at the launch of this worker's path
    startup_s: float | None = None  # launch to the first step: data found, counted and sharded, model built
    broadcast_s: float | None = None  # rank 0's state to every rank (a fixed set of workers)
    started_at: float | None = None  # time.time() at which training began (a fixed set of workers)
    first_epoch: int = 0
    first_step: int = 0
    rounds: list = dataclasses.field(default_factory=list)  # elastic rounds


def finish(cfg: Config, model, data, trainer, ckpts, history, epoch_end, timeline: Timeline) -> dict:
    """The summary, on every rank (it gathers: every rank calls it); rank 0 writes it with the model."""
    world = runtime.world()
    per_worker = runtime.gather(epoch_end.samples_per_sec())

    def slowest(value):  # the job waits for its slowest rank
        return max(runtime.gather(value)) if value is not None else None

    summary = {
        "world_size": world.size,
        "hosts": sorted(set(runtime.gather(socket.gethostname()))),
        "epochs": cfg.epochs,
        "first_epoch": timeline.first_epoch,
        "first_step": timeline.first_step,
        "epochs_run": len(history.epoch),
        "last_epoch": timeline.first_epoch + len(history.epoch),
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
        "optimizer": {**trainer.optimizer, "lr_scaled": trainer.peak_lr(cfg, world),
                      "schedule": _schedule(trainer.optimizer.get("schedule"))},
        "metrics": {k: float(v[-1]) for k, v in history.history.items()},
        # every epoch of this run: its metrics, and its training time (validation left out)
        "history": {**{k: [float(x) for x in v] for k, v in history.history.items()},
                    "epoch_seconds": epoch_end.epoch_seconds},
        "samples_per_sec_per_worker": per_worker,
        "samples_per_sec_total": sum(per_worker),
        "wall_time_s": time.time() - timeline.launched,
        "startup_s": slowest(timeline.startup_s),
        "broadcast_s": slowest(timeline.broadcast_s),
        "training_started_at": slowest(timeline.started_at),  # time.time()
        "checkpoint_save_s": ckpts.save_seconds,  # rank 0's: the others wait for it at the next step
        "weights_sha256_by_rank": runtime.gather(weights_sha256(model)),
        "precision": {"policy": _policy(model), "loss_scaling": _loss_scaling(model)},
        "elastic_rounds": timeline.rounds,
        "runtime_env": runtime.applied_defaults(),
        "stack": compat.stack(),  # Python, TensorFlow, Keras, numpy
        "config": cfg.to_dict(),
    }
    write(cfg, model, summary)
    log.info("done: %s", json.dumps(summary["metrics"]))
    return summary


def _schedule(schedule) -> dict | None:
    """A compiled learning-rate schedule as Keras serializes it (its class and config), or None."""
    import tensorflow as tf

    return None if schedule is None else json.loads(json.dumps(
        tf.keras.optimizers.schedules.serialize(schedule), default=str))


def weights_sha256(model) -> str:
    h = hashlib.sha256()
    for w in model.get_weights():  # a lookup layer's vocabulary is an array of Python objects
        h.update("\0".join(map(repr, w.ravel())).encode() if w.dtype == object else w.tobytes())
    return h.hexdigest()


def _policy(model) -> str:
    """The policy the model's layers compute in (the global policy when they were made)."""
    return model.dtype_policy.name


def _loss_scaling(model) -> bool:
    import tensorflow as tf

    return any(isinstance(o, tf.keras.mixed_precision.LossScaleOptimizer) for o in optimizer.found_in(model).values())


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
    except Exception as e:  # noqa: BLE001 (a loss or metric Keras cannot rebuild from its config: warned)
        log.warning("model.keras is saved without its compile state (%s); compile it after loading", failures.explain(e))
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
def write(cfg: Config, model, summary: dict):
    os.makedirs(cfg.run_dir, exist_ok=True)
    if rundir.read_summary(cfg).get("last_epoch", 0) > summary["last_epoch"]:  # e.g. --resume of an early ckpt
        rundir.keep_previous_run(cfg, keep=("checkpoints", "best.weights.h5"), why="this run covers fewer epochs than the one")
    if cfg.save_model:
        summary["model"]["file"] = export_model(model, cfg.run_dir)
    path = os.path.join(cfg.run_dir, "summary.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(summary, fh, indent=2)
    os.replace(path + ".tmp", path)
    runtime.say(f"hvdtrain: wrote {path}")
