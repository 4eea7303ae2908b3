"""Data sources, and the shard of them that this worker reads.

Every source becomes either in-memory arrays or a list of TFRecord files (or a user's tf.data
pipeline), and then one rule applies: each worker reads only its own shard, and every worker runs the
same number of steps per epoch, so an uneven split can never leave one rank waiting in an allreduce.

Shuffling is seeded by (seed, epoch), identical on every rank, and done *before* element sharding:
the union of the workers' batches at step k is then exactly the global batch one worker would see at
batch_size x workers, and a run resumed at epoch k sees the same order as an uninterrupted one.
"""
from __future__ import annotations

import glob
import importlib
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from .config import Config, UserError
from . import runtime
from .runtime import World

SPLIT_SEED = 0  # the train/validation split does not move with --seed, so runs stay comparable


@dataclass
class Data:
    """What the trainer needs: a per-epoch training pipeline and the facts about it."""
    epoch: Callable[[int], "tf.data.Dataset"]  # batched dataset for one epoch of this worker's shard
    val: Optional["tf.data.Dataset"]
    steps_per_epoch: int
    input_shape: tuple
    num_classes: int
    num_samples: int  # training samples in the whole data set
    sharding: str  # "element" or "file"

    def stream(self, first_epoch: int, epochs: int):
        """Epochs first_epoch..epochs-1 back to back, for model.fit(steps_per_epoch=...)."""
        import tensorflow as tf

        return (tf.data.Dataset.range(first_epoch, epochs)
                .flat_map(self.epoch)
                .prefetch(tf.data.AUTOTUNE))


def load(cfg: Config, world: World) -> Data:
    kind, _, arg = cfg.data.partition(":")
    if kind == "tfrecord":
        return _from_tfrecords(cfg, world, arg)
    if kind in _ARRAY_SOURCES:
        return _from_arrays(cfg, world, *_ARRAY_SOURCES[kind](cfg, arg))
    if kind == "npz":
        return _from_arrays(cfg, world, *_load_npz(cfg, arg))
    return _from_module(cfg, world)


# ---------------------------------------------------------------- sources that fit in memory

def _digits(cfg, _):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[..., None]
    return _split(x, d.target.astype(np.int64), cfg.val_split)


def _synthetic(cfg, _):
    """Random inputs with learnable labels (a fixed random linear map), the same on every rank."""
    rng = np.random.default_rng(1234)
    shape = tuple(cfg.synthetic_shape)
    x = rng.standard_normal((cfg.synthetic_samples, *shape), dtype=np.float32)
    w = rng.standard_normal((int(np.prod(shape)), cfg.synthetic_classes), dtype=np.float32)
    y = np.argmax(x.reshape(len(x), -1) @ w, axis=1).astype(np.int64)
    return _split(x, y, cfg.val_split)


def _keras_dataset(name):
    def load_(cfg, _):
        import tensorflow as tf

        try:
            (x, y), (xv, yv) = getattr(tf.keras.datasets, name).load_data()
        except Exception as e:
            raise UserError(f"--data {name}: could not download it ({type(e).__name__}); offline? "
                            f"Save it as npz (x, y, x_val, y_val) and use --data npz:PATH") from None
        x, xv = (a.astype(np.float32) / 255.0 for a in (x, xv))
        if x.ndim == 3:
            x, xv = x[..., None], xv[..., None]
        return x, y.reshape(-1).astype(np.int64), xv, yv.reshape(-1).astype(np.int64)
    return load_


_ARRAY_SOURCES = {"digits": _digits, "synthetic": _synthetic, "mnist": _keras_dataset("mnist"),
                  "fashion_mnist": _keras_dataset("fashion_mnist"), "cifar10": _keras_dataset("cifar10")}


def _load_npz(cfg, path):
    try:
        with np.load(path) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as e:
        raise UserError(f"--data npz:{path}: cannot read it as npz ({e})") from None
    for key in ("x", "y"):
        if key not in arrays:
            raise UserError(f"--data npz:{path}: no array '{key}' (has: {', '.join(arrays) or 'none'})")
    x, y = arrays["x"].astype(np.float32), _labels(arrays["y"], f"npz:{path} y")
    if len(x) != len(y):
        raise UserError(f"--data npz:{path}: x has {len(x)} samples but y has {len(y)}")
    if "x_val" in arrays and "y_val" in arrays:
        return x, y, arrays["x_val"].astype(np.float32), _labels(arrays["y_val"], f"npz:{path} y_val")
    return _split(x, y, cfg.val_split)


def _labels(y, what):
    """Class indices: integers >= 0 (a float label like 2.5 or a -1 would train on garbage)."""
    y = np.asarray(y).reshape(-1)
    if y.size and (not np.all(np.isfinite(y.astype(np.float64))) or np.any(y != np.round(y))):
        raise UserError(f"--data {what}: labels must be class indices (integers), got e.g. "
                        f"{y[np.flatnonzero(y != np.round(y))[:1]].tolist() or 'NaN'}")
    if y.size and y.min() < 0:
        raise UserError(f"--data {what}: labels must be >= 0, got {int(y.min())}")
    return y.astype(np.int64)


def _split(x, y, val_split):
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    n_val = int(round(len(x) * val_split))
    val, train = order[:n_val], order[n_val:]
    return x[train], y[train], x[val], y[val]


def _from_arrays(cfg: Config, world: World, x, y, xv, yv) -> Data:
    import tensorflow as tf

    n = len(x)
    steps = _steps(cfg, world, n // world.size, n)
    xt, yt = tf.constant(x), tf.constant(y)
    take = steps * cfg.batch_size

    def epoch(e):
        idx = tf.data.Dataset.range(n)
        if cfg.shuffle:
            idx = idx.shuffle(n, seed=_epoch_seed(cfg.seed, e), reshuffle_each_iteration=False)
        return (idx.shard(world.size, world.rank).take(take)
                .batch(cfg.batch_size, drop_remainder=True)
                .map(lambda i: (tf.gather(xt, i), tf.gather(yt, i))))

    val = None
    if len(xv):
        val = (tf.data.Dataset.from_tensor_slices((xv, yv)).shard(world.size, world.rank)
               .batch(cfg.batch_size))
    classes = int(max(y.max(initial=0), yv.max(initial=0))) + 1
    return Data(epoch, val, steps, tuple(x.shape[1:]), classes, n, "element")


def _epoch_seed(seed, epoch):
    """A tf.data seed from (seed, epoch): the same on every rank, different every epoch."""
    import tensorflow as tf

    return tf.cast(seed, tf.int64) * 1_000_003 + tf.cast(epoch, tf.int64)


def _steps(cfg: Config, world: World, shard_samples: int, total: int) -> int:
    steps = shard_samples // cfg.batch_size
    if steps == 0:
        raise UserError(f"--data {cfg.data}: {total} training samples is fewer than "
                        f"workers x batch size = {world.size} x {cfg.batch_size}; "
                        f"lower --batch-size or use fewer workers")
    return min(steps, cfg.steps_per_epoch or steps)


# ---------------------------------------------------------------- TFRecord files

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


def _parse_fn(shape):
    import tensorflow as tf

    spec = {"x": tf.io.FixedLenFeature([], tf.string), "y": tf.io.FixedLenFeature([], tf.int64)}

    def parse(record):
        ex = tf.io.parse_single_example(record, spec)
        x = tf.io.parse_tensor(ex["x"], tf.float32)
        x.set_shape(shape)
        return x, ex["y"]
    return parse


def _scan(files, take_shard=None):
    """Count records and find the largest label: one pass over the files this worker reads."""
    import tensorflow as tf

    ds = tf.data.TFRecordDataset(files)
    if take_shard:
        ds = ds.shard(*take_shard)
    spec = {"y": tf.io.FixedLenFeature([], tf.int64)}
    ds = ds.map(lambda r: tf.io.parse_single_example(r, spec)["y"]).batch(4096)
    count, top = 0, -1
    try:
        for labels in ds:
            count += int(labels.shape[0])
            top = max(top, int(tf.reduce_max(labels)))
    except tf.errors.OpError as e:
        raise UserError(f"cannot read TFRecords ({e.message.splitlines()[0]})") from None
    return count, top


def _from_tfrecords(cfg: Config, world: World, pattern: str) -> Data:
    import tensorflow as tf

    files = sorted(glob.glob(pattern))
    if not files:
        raise UserError(f"--data tfrecord:{pattern}: no files match")
    by_file = len(files) >= world.size
    mine = files[world.rank::world.size] if by_file else files
    count, top = _scan(mine, None if by_file else (world.size, world.rank))
    counts_tops = runtime.gather((count, top))
    shard_min = min(c for c, _ in counts_tops)
    total = sum(c for c, _ in counts_tops)  # shards are disjoint either way
    steps = _steps(cfg, world, shard_min, total)
    classes = max(t for _, t in counts_tops) + 1
    first = next(iter(tf.data.TFRecordDataset(files[:1]).take(1)))
    shape = tuple(tf.io.parse_tensor(tf.io.parse_single_example(
        first, {"x": tf.io.FixedLenFeature([], tf.string)})["x"], tf.float32).shape)
    parse = _parse_fn(shape)
    take = steps * cfg.batch_size

    def epoch(e):
        names = tf.data.Dataset.from_tensor_slices(mine)
        if cfg.shuffle:
            names = names.shuffle(len(mine), seed=_epoch_seed(cfg.seed, e), reshuffle_each_iteration=False)
        ds = names.interleave(tf.data.TFRecordDataset, cycle_length=min(4, len(mine)),
                              num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if not by_file:
            ds = ds.shard(world.size, world.rank)
        ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
        if cfg.shuffle:
            ds = ds.shuffle(min(10_000, take), seed=_epoch_seed(cfg.seed, e) + 1,
                            reshuffle_each_iteration=False)
        return ds.take(take).batch(cfg.batch_size, drop_remainder=True)

    return Data(epoch, None, steps, shape, classes, total, "file" if by_file else "element")


# ---------------------------------------------------------------- a user's own tf.data pipeline

def resolve(ref: str, what: str):
    """Import module:function, with one clear error when it does not."""
    mod_name, _, fn_name = ref.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:
        raise UserError(f"{what} {ref}: cannot import module '{mod_name}' ({type(e).__name__}: {e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UserError(f"{what} {ref}: module '{mod_name}' has no function '{fn_name}'")
    return fn


def _from_module(cfg: Config, world: World) -> Data:
    """`module:function` returns an unbatched tf.data.Dataset of (x, y), or a (train, val) pair.

    It describes the whole data set; hvdtrain shards it by element, shuffles and batches it.
    """
    import tensorflow as tf

    made = resolve(cfg.data, "--data")()
    train, val = made if isinstance(made, tuple) else (made, None)
    if not isinstance(train, tf.data.Dataset):
        raise UserError(f"--data {cfg.data}: expected a tf.data.Dataset of (x, y), got {type(train).__name__}")
    n = int(train.cardinality())
    if n < 0:
        n = int(train.reduce(np.int64(0), lambda c, _: c + 1))
    top = int(train.map(lambda x, y: tf.cast(tf.reduce_max(y), tf.int64))
              .reduce(np.int64(-1), tf.maximum))
    steps = _steps(cfg, world, n // world.size, n)
    take = steps * cfg.batch_size
    shape = tuple(train.element_spec[0].shape)

    def epoch(e):
        ds = train
        if cfg.shuffle:
            ds = ds.shuffle(min(n, 10_000), seed=_epoch_seed(cfg.seed, e), reshuffle_each_iteration=False)
        return ds.shard(world.size, world.rank).take(take).batch(cfg.batch_size, drop_remainder=True)

    if val is not None:
        val = val.shard(world.size, world.rank).batch(cfg.batch_size)
    return Data(epoch, val, steps, shape, top + 1, n, "element")
