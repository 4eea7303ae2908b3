"""The adapter for hvdtrain's own TFRecord files (`--data tfrecord:GLOB`, written by write_tfrecords):
tf.train.Example{x: a serialized float32 tensor, y: an int64 label}."""
from __future__ import annotations

import glob

import numpy as np

from ..config import DEFAULT_BATCH_SIZE, Config, Sharding, UserError
from ..runtime import World
from . import agree
from .core import WINDOW, Data, epoch_seed, permutation, window_shuffle


class Records:
    """Every worker reads its own files (by file), or, with fewer files than workers, all of them and
    keeps every size-th record (by element). An epoch reads this worker's files in an order drawn from
    (seed, epoch), its records shuffled in windows and parsed last, so that what a resume skips (whole
    files, then the raw records up to its window) is never parsed."""

    @staticmethod
    def can_handle(source) -> bool:
        return isinstance(source, str) and source.startswith("tfrecord:")

    def __init__(self, cfg: Config, world: World, source: str):
        pattern = source.partition(":")[2]
        self.cfg, self.world, self.files = cfg, world, sorted(glob.glob(pattern))
        if not self.files:
            raise UserError(f"--data tfrecord:{pattern}: no files match")
        self.batch = cfg.batch_size or DEFAULT_BATCH_SIZE
        self.by_file = len(self.files) >= world.size
        self.sharding = Sharding.FILE if self.by_file else Sharding.ELEMENT
        self.steps = 0  # agreed in load

    def shard(self) -> list:
        """This worker's files: its own, or all of them when there are fewer files than workers."""
        return self.files[self.world.rank::self.world.size] if self.by_file else self.files

    def count(self) -> int:
        """This worker's records (scanned by load: records per file)."""
        total = int(self.counts.sum())
        return total if self.by_file else agree.shard_size(total, self.world)

    def epoch(self, e, skip=0):
        """My files in epoch e's order, read one after another; the records shuffled in windows; from
        this worker's `skip`-th batch on (a resume)."""
        import tensorflow as tf

        cfg, world, batch, mine = self.cfg, self.world, self.batch, self.mine
        order = permutation(len(mine), epoch_seed(cfg.seed, e), -1) if cfg.shuffle else \
            tf.range(len(mine), dtype=tf.int64)
        names = tf.gather(tf.constant(mine), order)
        window, start = divmod(skip * batch, WINDOW)  # resume in this window of my records, at this place
        stride = 1 if self.by_file else world.size  # records of all files per record of mine
        if skip:
            records = records_from(names.numpy(), self.counts[order.numpy()], window * WINDOW * stride)
        else:
            records = tf.data.TFRecordDataset(names)
        if not self.by_file:
            records = records.shard(world.size, world.rank)
        if cfg.shuffle:
            records = window_shuffle(records, epoch_seed(cfg.seed, e), window)
        return (records.take(self.steps * batch - window * WINDOW).skip(start)
                .map(self.parse, num_parallel_calls=tf.data.AUTOTUNE)
                .batch(batch, drop_remainder=True))

    def load(self) -> Data:
        import tensorflow as tf

        self.mine = self.shard()
        self.counts, self.top = scan(self.mine)  # one pass over my files: records per file, the largest label
        self.steps, notes, total = agree.steps(self.cfg, self.world, self.count(), self.batch)
        classes = agree.largest(self.top) + 1
        first = next(iter(tf.data.TFRecordDataset(self.files[:1]).take(1)))
        shape = tuple(tf.io.parse_tensor(tf.io.parse_single_example(
            first, {"x": tf.io.FixedLenFeature([], tf.string)})["x"], tf.float32).shape)
        self.parse = parse_fn(shape)
        return Data(self.epoch, None, self.steps, self.batch, self.epoch(0).element_spec, total, self.sharding,
                    classes, notes=notes)


def write_tfrecords(x: np.ndarray, y: np.ndarray, prefix: str, num_files: int) -> list:
    """Write arrays as TFRecord files of tf.train.Example{x: serialized float32 tensor, y: int64}."""
    import tensorflow as tf

    paths = [f"{prefix}-{i:05d}-of-{num_files:05d}.tfrecord" for i in range(num_files)]
    writers = [tf.io.TFRecordWriter(p) for p in paths]
    for i, (xi, yi) in enumerate(zip(x, y)):
        ex = tf.train.Example(features=tf.train.Features(feature={
            "x": tf.train.Feature(bytes_list=tf.train.BytesList(
                value=[tf.io.serialize_tensor(np.asarray(xi, np.float32)).numpy()])),
            "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(yi)])),
        }))
        writers[i % num_files].write(ex.SerializeToString())
    for w in writers:
        w.close()
    return paths


def parse_fn(shape):
    import tensorflow as tf

    spec = {"x": tf.io.FixedLenFeature([], tf.string), "y": tf.io.FixedLenFeature([], tf.int64)}

    def parse(record):
        ex = tf.io.parse_single_example(record, spec)
        x = tf.io.parse_tensor(ex["x"], tf.float32)
        x.set_shape(shape)
        return x, ex["y"]
    return parse


def scan(files):
    """Records per file and the largest label: one pass over the files, labels parsed, nothing else."""
    import tensorflow as tf

    spec = {"y": tf.io.FixedLenFeature([], tf.int64)}
    ds = tf.data.Dataset.from_tensor_slices((tf.range(len(files), dtype=tf.int64), files)).interleave(
        lambda i, f: tf.data.TFRecordDataset(f).map(lambda r: (i, tf.io.parse_single_example(r, spec)["y"])),
        cycle_length=4, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False).batch(4096)
    counts, top = np.zeros(len(files), np.int64), -1
    try:
        for index, labels in ds:
            counts += np.bincount(index.numpy(), minlength=len(files))
            top = max(top, int(tf.reduce_max(labels)))
    except tf.errors.OpError as e:
        raise UserError(f"cannot read TFRecords ({e.message.splitlines()[0]})") from None
    return counts, top


def records_from(names, counts, start: int):
    """The records of `names` read in order, from record `start` on: whole files before it are not
    opened, and only the file it falls in is read up to it (raw, unparsed)."""
    import tensorflow as tf

    ends = np.cumsum(counts)
    first = int(np.searchsorted(ends, start, side="right"))
    if first >= len(names):
        return tf.data.TFRecordDataset(names[:0])
    within = start - (int(ends[first - 1]) if first else 0)
    return tf.data.TFRecordDataset(names[first:first + 1]).skip(within).concatenate(
        tf.data.TFRecordDataset(names[first + 1:]))
