"""What every adapter makes (Data) and the order it reads in: seeded by (seed, epoch), the same on every
rank, and rebuilt from any step of an epoch (a resume) without reading what came before."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from ..config import Sharding

SPLIT_SEED = 0  # the train/validation split does not move with --seed, so runs stay comparable
WINDOW = 10_000  # records shuffled together (a shuffle buffer's worth; rebuilt alone on resume)


@dataclass
class Data:
    """What the trainer needs: this worker's training stream and the facts about it."""
    epoch: Optional[Callable]  # (epoch, skip=0) -> batched dataset of this worker's shard; None: one stream
    val: Any  # this worker's part of the validation set, batched (a tf.data.Dataset), or None
    steps_per_epoch: int
    batch_size: int  # per worker
    element_spec: Any  # of one batch
    num_samples: Optional[int]  # training samples in the whole data set (None: not counted)
    sharding: Sharding
    num_classes: Optional[int] = None  # asked of the data for the built-in models only
    continuous: Any = None  # a repeating or infinite pipeline, batched (a tf.data.Dataset)
    notes: list = field(default_factory=list)  # lines rank 0 logs once
    unrepeatable: Optional[str] = None  # why an epoch's order cannot be reproduced (None: it can)

    def feed(self, first_epoch: int, skip: int = 0) -> tuple:
        """What model.fit reads from epoch first_epoch + 1 on: (dataset, its steps_per_epoch, the
        callbacks it needs).

        One epoch per iteration of the dataset: fit() given no steps_per_epoch makes a new iterator at
        every epoch's start, and its last call of an epoch ends where the data end, a shorter call of
        the same traced step (Keras 3's loop stops at the data's end; Keras 2 cuts the call short). So
        any steps per call suits any epoch's length, and every rank's calls end alike. The epoch an
        iteration reads is a variable that a callback sets at each epoch's start. skip: the first
        epoch without its first `skip` steps (a resume inside it), for a fit() of that epoch alone.
        One stream across epochs (an infinite pipeline) is read as it goes, steps_per_epoch a time."""
        import tensorflow as tf

        if self.epoch is None:  # Keras keeps one iterator across epochs when steps are given
            return self.continuous.prefetch(tf.data.AUTOTUNE), self.steps_per_epoch, []
        if skip:
            return self._counted(self.epoch(first_epoch, skip), self.steps_per_epoch - skip), None, []
        with tf.init_scope():
            current = tf.Variable(first_epoch, dtype=tf.int64, trainable=False, name="hvdtrain_epoch")

        class Epoch(tf.keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                current.assign(epoch)

        each = tf.data.Dataset.from_tensors(0).flat_map(lambda _: self.epoch(current.read_value()))
        return self._counted(each, self.steps_per_epoch), None, [Epoch()]

    @staticmethod
    def _counted(ds, steps: int):
        """ds, whose length Keras reads (its epoch's calls) and tf.data checks."""
        import tensorflow as tf

        return ds.apply(tf.data.experimental.assert_cardinality(steps)).prefetch(tf.data.AUTOTUNE)

    @property
    def input_shape(self):
        """The model's input shape, from the data: a tuple, or a dict/list of them for several inputs."""
        x = self.element_spec[0] if isinstance(self.element_spec, tuple) else self.element_spec
        import tensorflow as tf

        return tf.nest.map_structure(lambda s: tuple(s.shape[1:]), x)


def epoch_seed(seed, epoch):
    """A tf.data seed from (seed, epoch): the same on every rank, different every epoch."""
    import tensorflow as tf

    return tf.cast(seed, tf.int64) * 1_000_003 + tf.cast(epoch, tf.int64)


def permutation(n, seed, salt):
    """A permutation of range(n) drawn from (seed, salt): the same in a graph and eagerly."""
    import tensorflow as tf

    return tf.random.experimental.stateless_shuffle(
        tf.range(tf.cast(n, tf.int64)), seed=tf.stack([tf.cast(seed, tf.int64), tf.cast(salt, tf.int64)]))


def window_shuffle(ds, seed, first_window: int = 0):
    """Shuffle within consecutive windows of WINDOW elements, window i by the permutation of (seed, i):
    a run resumed inside an epoch rebuilds its window alone, where a shuffle buffer would need every
    element before it."""
    import tensorflow as tf

    def shuffle(i, window):
        order = permutation(tf.shape(tf.nest.flatten(window)[0])[0], seed, i)
        return tf.nest.map_structure(lambda t: tf.gather(t, order), window)

    return ds.batch(WINDOW).enumerate(first_window).map(shuffle).unbatch()


def split(x, y, val_split):
    """A fixed random split (SPLIT_SEED) of arrays, or of dicts/lists of arrays."""
    import tensorflow as tf

    n = len(tf.nest.flatten(y)[0])
    order = np.random.default_rng(SPLIT_SEED).permutation(n)
    n_val = int(round(n * (val_split or 0)))
    val, train = order[:n_val], order[n_val:]
    take = lambda a, idx: tf.nest.map_structure(lambda v: np.asarray(v)[idx], a)
    return take(x, train), take(y, train), take(x, val), take(y, val)


def last_fraction(data, fraction: float):
    """(train, validation): Keras' validation_split of (x, y) arrays, the last
    `fraction` of the samples held out, in their order. Keras takes it of arrays only; so does this."""
    import math

    import tensorflow as tf

    from ..config import UserError

    if not isinstance(data, (tuple, list)) or len(data) != 2 or \
            any(isinstance(d, tf.data.Dataset) or callable(d) for d in data):
        raise UserError("validation_split: Keras takes it of (x, y) arrays only; for a data set, give "
                        "validation_data, or --val-split for hvdtrain's own hold-out")
    if not 0 < fraction < 1:
        raise UserError(f"validation_split must be above 0 and below 1, got {fraction}")
    n = len(tf.nest.flatten(data[0])[0])
    at = int(math.floor(n * (1.0 - fraction)))  # where Keras splits
    cut = lambda part, s: tf.nest.map_structure(lambda v: np.asarray(v)[s], part)
    return tuple(cut(p, slice(None, at)) for p in data), tuple(cut(p, slice(at, None)) for p in data)
