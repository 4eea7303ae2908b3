"""Checkpoints that survive a crash and put every worker back in the same state.

Rank 0 alone writes: the data files of a checkpoint first, then the `checkpoint` index, replaced
atomically (TensorFlow's update_checkpoint_state), so a crash mid-write leaves the previous checkpoint as
the latest; the last K are kept. `ckpt-E` is written at the end of epoch E; `ckpt-E-step-S` after S
steps of epoch E+1 (--checkpoint-every-steps/-minutes), with what each rank holds alone (BatchNorm's
moving statistics, averaged only at epoch ends) so that a resume inside an epoch continues bit for bit.
Resuming restores on rank 0 and broadcasts model, optimizer and position, so workers on hosts without
a shared file system resume too.

Beside the checkpoints, config.json says which job wrote them (a checkpoint of another job is refused,
not half-restored), how far it got and with how many workers.
"""
from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np

from . import compat, runtime, watchdog
from .config import Config, UserError
from .optimizer import broadcast_initial_state, build
from .runtime import log

META = "config.json"


class Checkpoints:
    def __init__(self, cfg: Config, model):
        import tensorflow as tf

        self.cfg, self.model = cfg, model
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")  # epochs completed
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")  # steps into the next
        self.ckpt = tf.train.Checkpoint(model=compat.checkpointed(model), optimizer=model.optimizer,
                                        epoch=self.epoch, step=self.step)
        self.ckpt.save_counter  # noqa: B018 (reading it creates it, so that ckpt.write stores it as CheckpointManager did)
        self.resumed_from: dict | None = None  # the meta of the checkpoint this run resumed from
        self.ranks = None  # on resume: every rank's own state, as saved (see gather_per_rank_state)
        self.save_seconds: list[float] = []  # what each save cost this rank (the bench reads rank 0's)
        self.last_saved: tuple[int, int] | None = None  # (epoch, step) of the last save

    def find(self) -> str | None:
        """The checkpoint to resume from: --resume, else the latest in the run's checkpoint dir."""
        return find(self.cfg)

    def restore_and_broadcast(self) -> tuple:
        """Rank 0 restores (if there is a checkpoint), then every rank takes rank 0's state, and its
        own part of the per-rank state. Returns (epoch, step) to start from: `step` steps into epoch
        `epoch` + 1. Called on every rank: it contains collectives.
        """
        path = runtime.all_ranks_agree(self.restore_on_rank0)
        broadcast_initial_state(self.model)
        where = (int(self.epoch.numpy()), int(self.step.numpy()))
        if runtime.world().size > 1:
            import horovod.tensorflow as hvd

            path, where, self.resumed_from, self.ranks = hvd.broadcast_object(
                (path, where, self.resumed_from, self.ranks), root_rank=0)
            self.epoch.assign(where[0])
            self.step.assign(where[1])
        self.take_own_state()
        return where

    def take_own_state(self):
        """After a resume inside an epoch: this rank's own non-trainable state as it was saved, or
        (with another number of workers) the average over the ranks that saved it."""
        if self.ranks is None or not self.ranks.size:
            return
        world = runtime.world()
        row = self.ranks[world.rank] if len(self.ranks) == world.size else self.ranks.mean(axis=0)
        variables = per_rank_variables(self.model)
        if row.size != sum(int(np.prod(v.shape)) for v in variables):
            variables = per_rank_variables(self.model, frozen=True)  # written before frozen ones were left out
        offset = 0
        for v in variables:
            n = int(np.prod(v.shape))
            v.assign(row[offset:offset + n].reshape(v.shape).astype(v.dtype.as_numpy_dtype))
            offset += n

    def restore_on_rank0(self) -> str | None:
        """Rank 0 loads the checkpoint to resume from, if there is one; other ranks do nothing.

        No collectives: elastic training calls this alone and lets hvd.elastic's sync broadcast.
        """
        build(self.model)
        if not runtime.world().is_chief:
            return None
        path = self.find()
        if path:
            import tensorflow as tf

            self.resumed_from = check_same_job(self.cfg, path, setup_of(self.model))
            try:
                self.ranks = tf.train.load_variable(path, RANKS)
                self.ckpt.ranks = tf.Variable(np.zeros_like(self.ranks), trainable=False, name="ranks")
            except (tf.errors.OpError, ValueError):  # not in it, or unreadable: restoring it says why
                self.ranks = None
            try:
                self.ckpt.restore(path).assert_consumed()
            except (tf.errors.OpError, IndexError, ValueError, AssertionError) as e:  # "not this checkpoint"
                raise UserError(self._explain(path, e)) from None
            step = int(self.step.numpy())
            log.info("resumed from %s at epoch %d%s", path, int(self.epoch.numpy()),
                     f", step {step}" if step else "")
        return path

    def _explain(self, path: str, error: Exception) -> str:
        """Why a checkpoint does not restore into this model, naming the variables that differ."""
        import tensorflow as tf

        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        try:
            theirs = dict(tf.train.list_variables(path))
        except (tf.errors.OpError, ValueError):  # unreadable: a corrupt file
            return f"cannot restore checkpoint {path}: {first}"
        with tempfile.TemporaryDirectory() as tmp:  # this model's variables, under the same names
            mine = tf.train.Checkpoint(model=compat.checkpointed(self.model)).write(f"{tmp}/c")
            ours = dict(tf.train.list_variables(mine))
        weights = lambda d: {k: v for k, v in d.items() if k.startswith("model/") and "optimizer" not in k
                             and "OPTIMIZER_SLOT" not in k}  # the model's own variables, not its optimizer's
        ours, theirs_model = weights(ours), weights(theirs)
        layers = [layer.name for layer in self.model.layers if layer.weights]

        name = lambda key: compat.checkpoint_key_name(key, layers)  # noqa: E731
        diff = [f"{name(k)} is {tuple(theirs_model[k])} there, {tuple(ours[k])} here"
                for k in sorted(set(ours) & set(theirs_model)) if theirs_model[k] != ours[k]]
        diff += [f"{name(k)} is only here" for k in sorted(set(ours) - set(theirs_model))]
        diff += [f"{name(k)} is only there" for k in sorted(set(theirs_model) - set(ours))]
        if not diff:
            return f"cannot restore checkpoint {path}: {first}"
        shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
        return (f"checkpoint {path} was written by a different model (edited since?): {shown}. "
                f"--no-auto-resume starts over (the old run is kept aside), or use another --output-dir")

    def save(self, epoch: int, step: int = 0):
        """Every rank calls it (inside an epoch, gathering each rank's own state is a collective);
        rank 0 writes. At an epoch's end that state is already averaged: one row holds it."""
        t0 = time.perf_counter()
        ranks = gather_per_rank_state(self.model) if step else own_state(self.model)[None]
        if runtime.world().is_chief:
            with watchdog.busy("writing a checkpoint"):  # the others wait in the next allreduce: no hang
                self._write(epoch, step, ranks)
        self.save_seconds.append(time.perf_counter() - t0)
        self.last_saved = (epoch, step)

    def _write(self, epoch: int, step: int, ranks):
        """CheckpointManager's steps (write the files, then the index atomically, then drop the oldest)
        under our names: it numbers checkpoints, and a step checkpoint needs epoch and step."""
        import tensorflow as tf
        self.epoch.assign(epoch)
        self.step.assign(step)
        self.ckpt.ranks = tf.Variable(ranks, trainable=False, name="ranks")
        name = f"ckpt-{epoch}" + (f"-step-{step}" if step else "")
        directory = self.cfg.checkpoint_dir
        path = self.ckpt.write(os.path.join(directory, name))
        state = tf.train.get_checkpoint_state(directory)
        kept = [p for p in (state.all_model_checkpoint_paths if state else []) if p != path] + [path]
        kept, dropped = kept[-self.cfg.keep_checkpoints:], kept[:-self.cfg.keep_checkpoints]
        compat.update_checkpoint_state(directory, path, kept)  # atomic
        for old in dropped:
            for f in tf.io.gfile.glob(old + ".*"):
                tf.io.gfile.remove(f)
        tmp = os.path.join(directory, META + ".tmp")
        with open(tmp, "w") as fh:
            json.dump({"epoch": epoch, "step": step, "checkpoint": os.path.basename(path),
                       "world_size": runtime.world().size, "config": self.cfg.to_dict(),
                       "setup": setup_of(self.model)}, fh, indent=2)
        os.replace(tmp, os.path.join(directory, META))
        log.info("checkpoint %s", path)


RANKS = "ranks/.ATTRIBUTES/VARIABLE_VALUE"


def per_rank_variables(model, frozen: bool = False) -> list:
    """What each rank holds alone between epoch ends: the non-trainable float variables of layers that
    train (BatchNorm's moving statistics), averaged over ranks only at the end of an epoch. A frozen
    layer (`trainable = False`: a pretrained base; its BatchNorm runs in inference mode) never changes
    its variables, so they stay as rank 0 broadcast them and are left out: one copy in a checkpoint,
    not one per rank. (Keras also lists lookup tables' handlers here, TextVectorization's and
    StringLookup's: not variables, left out.) `frozen=True`: the frozen ones too, as checkpoints
    written before they were left out hold them."""
    import tensorflow as tf

    fixed = set() if frozen else {v.ref() for layer in compat.sublayers(model)
                                  if isinstance(layer, tf.keras.layers.Layer) and not layer.trainable
                                  for v in compat.tf_variables(layer.weights)}
    return [v for v in compat.tf_variables(model.non_trainable_variables)
            if v.dtype.is_floating and v.ref() not in fixed]


def own_state(model):
    """This rank's per_rank_variables, flattened, as float64 (exact for float32)."""
    variables = per_rank_variables(model)
    return np.concatenate([np.ravel(v.numpy()).astype(np.float64) for v in variables]) if variables \
        else np.zeros(0)


def gather_per_rank_state(model):
    """[ranks, values]: every rank's own_state."""
    import tensorflow as tf

    mine = own_state(model)
    if runtime.world().size == 1:
        return mine[None]
    import horovod.tensorflow as hvd

    with runtime.collective("a checkpoint's gather of every rank's state (hvdtrain.rank_state)"):
        return hvd.allgather(tf.constant(mine[None]), name="hvdtrain.rank_state").numpy()


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
    except (tf.errors.OpError, ValueError):  # unreadable: restoring it will say why
        return 0


MUST_MATCH = ("model", "data", "optimizer", "precision", "synthetic_shape", "synthetic_classes")
# what hvdtrain.fit named a (train, val) pair or (x, y) arrays before they were named "dataset" and
# "arrays": its checkpoints still resume
_FORMER_NAMES = {("data", "tuple"): ("dataset", "arrays")}


def setup_of(model) -> dict:
    """What a later phase of a training script changes (unfreezing, another optimizer), which a
    checkpoint it resumes from must share: the weights that train, and the optimizer's class."""
    from .optimizer import user_class

    return {"trainable": [compat.variable_path(v) for v in model.trainable_weights],
            "optimizer": user_class(model.optimizer).__name__}


def check_same_job(cfg: Config, path: str, setup: dict | None = None) -> dict:
    """A checkpoint of another model would half-restore (TensorFlow only warns), and one of another
    phase (other weights trainable, another optimizer) would resume the wrong training: refuse them.
    Returns the checkpoint's meta."""
    found = meta(path)
    saved, now = found.get("config", {}), cfg.to_dict()
    diff = [f"{k}: {saved[k]!r} there, {now[k]!r} now" for k in MUST_MATCH
            if k in saved and saved[k] != now[k] and now[k] not in _FORMER_NAMES.get((k, saved[k]), ())]
    if diff:
        raise UserError(f"checkpoint {path} belongs to a different job ({'; '.join(diff)}); "
                        f"use another --output-dir, or --no-auto-resume to start over")
    then = found.get("setup")
    if setup is not None and then is not None and then != setup:
        raise UserError(f"checkpoint {path} was trained with {_setup_diff(then, setup)}: another phase of "
                        f"training? Each hvdtrain.fit of one script on the same output_dir trains in its own "
                        f"fit-N sub-directory; from another script, give it another output_dir (--output-dir), "
                        f"or auto_resume=False (--no-auto-resume) to start over (the earlier run is kept aside)")
    return found


def _setup_diff(then: dict, now: dict) -> str:
    said = []
    if then["trainable"] != now["trainable"]:
        only_then = [v for v in then["trainable"] if v not in now["trainable"]]
        only_now = [v for v in now["trainable"] if v not in then["trainable"]]
        said.append(f"{len(then['trainable'])} trainable weights where this model has {len(now['trainable'])}"
                    + (f" ({only_now[0]} trains here only" if only_now else f" ({only_then[0]} trained there only")
                    + ")")
    if then["optimizer"] != now["optimizer"]:
        said.append(f"the optimizer {then['optimizer']} where this model has {now['optimizer']}")
    return " and ".join(said)
