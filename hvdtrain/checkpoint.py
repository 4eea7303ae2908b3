"""Checkpoints that survive a crash and put every worker back in the same state.

Rank 0 alone writes, through tf.train.CheckpointManager: the data files of ckpt-N are written first
and the `checkpoint` index is replaced atomically afterwards, so a crash mid-write leaves the previous
checkpoint as the latest; the manager keeps the last K. Resuming restores on rank 0 and broadcasts
model, optimizer and position, so workers on hosts without a shared file system resume too.

Beside the checkpoints, config.json says which job wrote them (a checkpoint of another job is refused,
not half-restored), how far it got and with how many workers.
"""
from __future__ import annotations

import json
import os
import tempfile

from . import runtime
from .config import Config, UserError
from .optimizer import broadcast_initial_state, build
from .runtime import log, rank0_only

META = "config.json"


class Checkpoints:
    def __init__(self, cfg: Config, model):
        import tensorflow as tf

        self.cfg, self.model = cfg, model
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")  # epochs completed
        self.ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer, epoch=self.epoch)
        self._manager = None
        self.resumed_from = None  # the meta of the checkpoint this run resumed from

    @property
    def manager(self):
        """Made by whichever process is rank 0 when it first saves (elastic resets can move rank 0)."""
        import tensorflow as tf

        if self._manager is None:
            self._manager = tf.train.CheckpointManager(self.ckpt, self.cfg.checkpoint_dir,
                                                       max_to_keep=self.cfg.keep_checkpoints)
        return self._manager

    def find(self) -> str | None:
        """The checkpoint to resume from: --resume, else the latest in the run's checkpoint dir."""
        return find(self.cfg)

    def restore_and_broadcast(self) -> int:
        """Rank 0 restores (if there is a checkpoint), then every rank takes rank 0's state.

        Returns the epoch to start from. Called on every rank: it contains collectives.
        """
        path = runtime.all_ranks_agree(self.restore_on_rank0)
        broadcast_initial_state(self.model)
        epoch = int(self.epoch.numpy())
        if runtime.world().size > 1:
            import horovod.tensorflow as hvd

            path, epoch, self.resumed_from = hvd.broadcast_object((path, epoch, self.resumed_from), root_rank=0)
            self.epoch.assign(epoch)
        return epoch

    def restore_on_rank0(self) -> str | None:
        """Rank 0 loads the checkpoint to resume from, if there is one; other ranks do nothing.

        No collectives: elastic training calls this alone and lets hvd.elastic's sync broadcast.
        """
        build(self.model)
        if not runtime.world().is_chief:
            return None
        path = self.find()
        if path:
            self.resumed_from = check_same_job(self.cfg, path)
            try:
                self.ckpt.restore(path).assert_consumed()
            except Exception as e:  # OpError, IndexError, ValueError: all mean "not this checkpoint"
                raise UserError(self._explain(path, e)) from None
            log.info("resumed from %s at epoch %d", path, int(self.epoch.numpy()))
        return path

    def _explain(self, path: str, error: Exception) -> str:
        """Why a checkpoint does not restore into this model, naming the variables that differ."""
        import tensorflow as tf

        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        try:
            theirs = dict(tf.train.list_variables(path))
        except Exception:  # unreadable: a corrupt file
            return f"cannot restore checkpoint {path}: {first}"
        with tempfile.TemporaryDirectory() as tmp:  # this model's variables, under the same names
            ours = dict(tf.train.list_variables(tf.train.Checkpoint(model=self.model).write(f"{tmp}/c")))
        weights = lambda d: {k: v for k, v in d.items() if k.startswith("model/") and "optimizer" not in k
                             and "OPTIMIZER_SLOT" not in k}  # the model's own variables, not its optimizer's
        ours, theirs_model = weights(ours), weights(theirs)
        layers = [layer.name for layer in self.model.layers if layer.weights]

        def name(key):  # model/layer_with_weights-1/kernel/... -> hidden/kernel (this model's layer names)
            parts = key[len("model/"):].replace("/.ATTRIBUTES/VARIABLE_VALUE", "").split("/")
            i = parts[0].rsplit("-", 1)[-1]
            if parts[0].startswith("layer_with_weights-") and i.isdigit() and int(i) < len(layers):
                parts[0] = layers[int(i)]
            return "/".join(parts)
        diff = [f"{name(k)} is {tuple(theirs_model[k])} there, {tuple(ours[k])} here"
                for k in sorted(set(ours) & set(theirs_model)) if theirs_model[k] != ours[k]]
        diff += [f"{name(k)} is only here" for k in sorted(set(ours) - set(theirs_model))]
        diff += [f"{name(k)} is only there" for k in sorted(set(theirs_model) - set(ours))]
        if not diff:
            return f"cannot restore checkpoint {path}: {first}"
        shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
        return (f"checkpoint {path} was written by a different model (edited since?): {shown}. "
                f"--no-auto-resume starts over (the old run is kept aside), or use another --output-dir")

    def callback(self):
        import tensorflow as tf

        ckpts, cfg = self, self.cfg

        class SaveCheckpoint(tf.keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                done = epoch + 1
                if done % cfg.checkpoint_every == 0 or done == cfg.epochs:
                    ckpts.save(done)

        return SaveCheckpoint()

    @rank0_only
    def save(self, epoch: int):
        self.epoch.assign(epoch)
        path = self.manager.save(checkpoint_number=epoch)
        tmp = os.path.join(self.cfg.checkpoint_dir, META + ".tmp")
        with open(tmp, "w") as fh:
            json.dump({"epoch": epoch, "checkpoint": os.path.basename(path),
                       "world_size": runtime.world().size, "config": self.cfg.to_dict()}, fh, indent=2)
        os.replace(tmp, os.path.join(self.cfg.checkpoint_dir, META))
        log.info("checkpoint %s", path)


def find(cfg: Config) -> str | None:
    """The checkpoint a run of `cfg` resumes from: --resume, else the latest in its checkpoint dir."""
    import tensorflow as tf

    if cfg.resume:
        if os.path.isdir(cfg.resume):
            path = tf.train.latest_checkpoint(cfg.resume)
            if not path:
                raise UserError(f"--resume {cfg.resume}: no checkpoint in this directory")
            return path
        return cfg.resume
    if cfg.auto_resume and os.path.isdir(cfg.checkpoint_dir):
        return tf.train.latest_checkpoint(cfg.checkpoint_dir)
    return None


def meta(path: str) -> dict:
    """What config.json beside a checkpoint says ({} when there is none)."""
    meta_file = os.path.join(os.path.dirname(path), META)
    if not os.path.exists(meta_file):
        return {}
    with open(meta_file) as fh:
        return json.load(fh)


def epoch_of(path: str) -> int:
    """The epoch a checkpoint was written at (read from it: config.json speaks for the latest only)."""
    import tensorflow as tf

    try:
        return int(tf.train.load_variable(path, "epoch/.ATTRIBUTES/VARIABLE_VALUE"))
    except Exception:  # unreadable: restoring it will say why
        return 0


MUST_MATCH = ("model", "data", "optimizer", "precision", "synthetic_shape", "synthetic_classes")


def check_same_job(cfg: Config, path: str) -> dict:
    """A checkpoint of another model would half-restore (TensorFlow only warns): refuse it.
    Returns the checkpoint's meta."""
    found = meta(path)
    saved, now = found.get("config", {}), cfg.to_dict()
    diff = [f"{k}: {saved[k]!r} there, {now[k]!r} now" for k in MUST_MATCH
            if k in saved and saved[k] != now[k]]
    if diff:
        raise UserError(f"checkpoint {path} belongs to a different job ({'; '.join(diff)}); "
                        f"use another --output-dir, or --no-auto-resume to start over")
    return found
