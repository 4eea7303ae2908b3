"""Checkpoints that survive a crash and put every worker back in the same state.

Rank 0 alone writes, through tf.train.CheckpointManager: the data files of ckpt-N are written first
and the `checkpoint` index is replaced atomically afterwards, so a crash mid-write leaves the previous
checkpoint as the latest; the manager keeps the last K. Resuming restores on rank 0 and broadcasts
model, optimizer and epoch, so workers on hosts without a shared file system resume too.
"""
from __future__ import annotations

import json
import os

from .config import Config, UserError
from . import runtime
from .runtime import log, rank0_only


class Checkpoints:
    def __init__(self, cfg: Config, model):
        import tensorflow as tf

        self.cfg, self.model = cfg, model
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        self.ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer, epoch=self.epoch)
        self._manager = None

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
        import tensorflow as tf

        if self.cfg.resume:
            if os.path.isdir(self.cfg.resume):
                path = tf.train.latest_checkpoint(self.cfg.resume)
                if not path:
                    raise UserError(f"--resume {self.cfg.resume}: no checkpoint in this directory")
                return path
            return self.cfg.resume
        if self.cfg.auto_resume and os.path.isdir(self.cfg.checkpoint_dir):
            return tf.train.latest_checkpoint(self.cfg.checkpoint_dir)
        return None

    def restore_and_broadcast(self) -> int:
        """Rank 0 restores (if there is a checkpoint), then every rank takes rank 0's state.

        Returns the epoch to start from. Called on every rank: it contains collectives.
        """
        from .train import broadcast_initial_state

        path = runtime.all_ranks_agree(self.restore_on_rank0)
        broadcast_initial_state(self.model)
        epoch = int(self.epoch.numpy())
        if runtime.world().size > 1:
            import horovod.tensorflow as hvd

            path, epoch = hvd.broadcast_object((path, epoch), root_rank=0)
            self.epoch.assign(epoch)
        return epoch

    def restore_on_rank0(self) -> str | None:
        """Rank 0 loads the checkpoint to resume from, if there is one; other ranks do nothing.

        No collectives: elastic training calls this alone and lets hvd.elastic's sync broadcast.
        """
        from .train import build_optimizer

        build_optimizer(self.model)
        if not runtime.world().is_chief:
            return None
        path = self.find()
        if path:
            self.check_same_job(path)
            try:
                self.ckpt.restore(path).assert_consumed()
            except Exception as e:  # OpError, IndexError, ValueError: all mean "not this checkpoint"
                raise UserError(f"cannot restore checkpoint {path}: "
                                f"{str(e).strip().splitlines()[0][:300]}") from None
            log.info("resumed from %s at epoch %d", path, int(self.epoch.numpy()))
        return path

    MUST_MATCH = ("model", "data", "optimizer", "precision", "synthetic_shape", "synthetic_classes")

    def check_same_job(self, path: str):
        """A checkpoint of another model would half-restore (TensorFlow only warns): refuse it."""
        meta_file = os.path.join(os.path.dirname(path), "config.json")
        if not os.path.exists(meta_file):
            return
        with open(meta_file) as fh:
            saved = json.load(fh).get("config", {})
        now = self.cfg.to_dict()
        diff = [f"{k}: {saved[k]!r} there, {now[k]!r} now" for k in self.MUST_MATCH
                if k in saved and saved[k] != now[k]]
        if diff:
            raise UserError(f"checkpoint {path} belongs to a different job ({'; '.join(diff)}); "
                            f"use another --output-dir, or --no-auto-resume to start over")

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
        tmp = os.path.join(self.cfg.checkpoint_dir, "config.json.tmp")
        with open(tmp, "w") as fh:
            json.dump({"epoch": epoch, "checkpoint": os.path.basename(path), "config": self.cfg.to_dict()},
                      fh, indent=2)
        os.replace(tmp, os.path.join(self.cfg.checkpoint_dir, "config.json"))
        log.info("checkpoint %s", path)
