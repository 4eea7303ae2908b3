"""The adapter for a keras.utils.Sequence (Keras 3: PyDataset): batches read by index, as Keras' fit
reads them."""
from __future__ import annotations

import numpy as np

from .. import compat
from ..config import Config, Sharding, UserError
from ..runtime import World
from . import agree
from .core import Data, epoch_seed, permutation


class Sequences:
    """Each worker takes its own batches by index: the epoch's order of all batches (a permutation
    drawn from (seed, epoch) when shuffling, as Keras' fit shuffles a Sequence's batches), then every
    size-th from this rank's. Batches are read by __getitem__ only as training reaches them (a resume
    skips indices, not data), and on_epoch_end runs after each epoch, as in Keras' fit; a resumed run
    calls it for the epochs it skips, so a Sequence that reshuffles there does again."""
    sharding = Sharding.BATCH

    @staticmethod
    def can_handle(source) -> bool:
        import tensorflow as tf

        return isinstance(source, tf.keras.utils.Sequence)

    def __init__(self, cfg: Config, world: World, seq, validation, need_classes):
        self.cfg, self.world, self.seq, self.validation, self.need_classes = cfg, world, seq, validation, need_classes
        self.n, self.steps = len(seq), 0  # steps: agreed in load
        self.ended, self.before = 0, compat.sequence_epoch_ends_before_training()  # on_epoch_end: made, owed

    def count(self) -> int:
        """This rank's batches in an epoch."""
        return agree.shard_size(self.n, self.world)

    def shard(self, e) -> np.ndarray:
        """This rank's batch indices in epoch e, as many as every rank runs."""
        n, cfg = self.n, self.cfg
        order = np.asarray(permutation(n, epoch_seed(cfg.seed, e), 0)) if cfg.shuffle else np.arange(n)
        return order[self.world.rank::self.world.size][:self.steps]

    def epoch(self, e, skip=0):
        """Epoch e's batches of this rank, from its `skip`-th on (a resume)."""
        import tensorflow as tf

        return tf.data.Dataset.from_generator(self._batches, output_signature=self.spec, args=(e, skip))

    def _batches(self, e, skip):
        e, skip, seq = int(e), int(skip), self.seq
        while self.ended < e + self.before:  # a resumed run: the epochs before it, ended as they were
            seq.on_epoch_end()
            self.ended += 1
        if hasattr(seq, "on_epoch_begin"):  # Keras 3's PyDataset
            seq.on_epoch_begin()
        mine = self.shard(e)
        for k in range(skip, self.steps):
            item = as_batch(seq[int(mine[k])], "the Sequence")
            if k == self.steps - 1:  # Keras reads no further than the epoch's last batch: end it here
                seq.on_epoch_end()
                self.ended += 1
            yield item

    def load(self) -> Data:
        import tensorflow as tf

        cfg, world, seq, validation = self.cfg, self.world, self.seq, self.validation
        self.steps, notes, _ = agree.steps(cfg, world, self.count(), 1, unit="batches")
        first = as_batch(seq[0], "the Sequence")
        self.spec = batch_spec(first)
        val = None
        if validation is not None:
            if not self.can_handle(validation):
                raise UserError(f"--data {cfg.data}: with a Sequence for training, validation data must be a "
                                f"Sequence too, got {type(validation).__name__}")
            mine = range(world.rank, len(validation), world.size)
            val = tf.data.Dataset.from_generator(
                lambda: (as_batch(validation[i], "the validation Sequence") for i in mine),
                output_signature=batch_spec(as_batch(validation[0], "the validation Sequence")))
            val = val.apply(tf.data.experimental.assert_cardinality(len(mine)))
        classes = None
        if self.need_classes:
            labels = [np.asarray(tf.nest.flatten(as_batch(seq[i], "the Sequence")[1])[0]) for i in range(self.n)]
            classes = labels[0].shape[1] if labels[0].ndim == 2 else int(max(l.max() for l in labels)) + 1
        batch = len(tf.nest.flatten(first)[0])
        return Data(self.epoch, val, self.steps, batch, self.spec, None, self.sharding, classes, notes=notes)


def batch_spec(batch):
    """tf.data's signature of a Sequence's batches, from one: any batch size, the rest as it is."""
    import tensorflow as tf

    return tf.nest.map_structure(lambda a: tf.TensorSpec((None, *a.shape[1:]), tf.as_dtype(a.dtype)), batch)


def as_batch(item, what: str):
    """A Sequence's item as tf.data takes it: (x, y) or (x, y, w) as a tuple, arrays as numpy."""
    import tensorflow as tf

    if isinstance(item, list):
        item = tuple(item)
    if not isinstance(item, tuple) or len(item) not in (1, 2, 3):
        raise UserError(f"{what}: __getitem__ must return (x, y) or (x, y, sample_weight), "
                        f"got {type(item).__name__}")
    return tf.nest.map_structure(np.asarray, item)
