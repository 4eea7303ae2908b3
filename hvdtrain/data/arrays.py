"""The adapter for data in memory: (x, y) arrays (or dicts/lists of them), an npz file, and the built-in
sets (digits, synthetic, mnist, fashion_mnist, cifar10), which are arrays once loaded."""
from __future__ import annotations

import zipfile

import numpy as np

from ..config import BUILT_IN_VAL_SPLIT, DEFAULT_BATCH_SIZE, Config, Sharding, UserError
from ..runtime import World
from . import agree
from .core import Data, epoch_seed, permutation, split


class Arrays:
    """Shuffle the indices, shard them, gather the batches: the arrays are never copied per epoch."""
    sharding = Sharding.ELEMENT

    @staticmethod
    def can_handle(source) -> bool:
        """(x, y) arrays, or a --data string naming a built-in set or an npz file."""
        if isinstance(source, str):
            kind, _, _ = source.partition(":")
            return kind in BUILT_IN or kind == "npz"
        return isinstance(source, (tuple, list)) and len(source) == 2

    @classmethod
    def named(cls, cfg: Config, world: World, source: str, need_classes):
        """A built-in set or an npz file, as arrays (with its validation split)."""
        kind, _, arg = source.partition(":")
        load = load_npz if kind == "npz" else BUILT_IN[kind]
        return cls(cfg, world, *load(cfg, arg, need_classes))

    def __init__(self, cfg: Config, world: World, x, y, xv=None, yv=None):
        import tensorflow as tf

        self.cfg, self.world, self.x, self.y, self.xv, self.yv = cfg, world, x, y, xv, yv
        self.batch = cfg.batch_size or DEFAULT_BATCH_SIZE
        self.n = len(tf.nest.flatten(y)[0])
        self.steps = 0  # agreed in load

    def count(self) -> int:
        """This rank's samples in an epoch."""
        return agree.shard_size(self.n, self.world)

    def shard(self, e):
        """This rank's sample indices in epoch e, in order, as many as every rank trains on."""
        import tensorflow as tf

        # stateless: shuffle(seed=a tensor) fails to trace under the global seed 0 (--seed 0)
        idx = tf.data.Dataset.from_tensor_slices(permutation(self.n, epoch_seed(self.cfg.seed, e), 0)) \
            if self.cfg.shuffle else tf.data.Dataset.range(self.n)
        return idx.shard(self.world.size, self.world.rank).take(self.steps * self.batch)

    def epoch(self, e, skip=0):
        """Epoch e's batches of this rank, from its `skip`-th on: index batches are skipped, so a resume
        reads no data."""
        import tensorflow as tf

        xt, yt = self.tensors
        return (self.shard(e).batch(self.batch, drop_remainder=True).skip(skip)
                .map(lambda i: tf.nest.map_structure(lambda a: tf.gather(a, i), (xt, yt))))

    def load(self) -> Data:
        import tensorflow as tf

        cfg, world, x, y, xv, yv = self.cfg, self.world, self.x, self.y, self.xv, self.yv
        self.steps, notes, _ = agree.steps(cfg, world, self.count(), self.batch)
        self.tensors = tf.nest.map_structure(tf.constant, x), tf.nest.map_structure(tf.constant, y)
        val = None
        if xv is not None and len(tf.nest.flatten(yv)[0]):
            val = tf.data.Dataset.from_tensor_slices((xv, yv)).shard(world.size, world.rank).batch(self.batch)
        classes, labels = None, np.asarray(tf.nest.flatten(y)[0])
        if labels.ndim == 2:  # one-hot
            classes = labels.shape[1]
        elif np.issubdtype(labels.dtype, np.integer):
            classes = max(int(np.max(a, initial=0)) for a in (labels, *tf.nest.flatten(yv)[:1])
                          if a is not None) + 1
        return Data(self.epoch, val, self.steps, self.batch, self.epoch(0).element_spec, self.n, self.sharding,
                    classes, notes=notes)


# ---------------------------------------------------------------- the sets that load as arrays

def digits(cfg, _, need_classes):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[..., None]
    return split(x, d.target.astype(np.int64), built_in_split(cfg))


def synthetic(cfg, _, need_classes):
    """Random inputs with learnable labels (a fixed random linear map), the same on every rank."""
    rng = np.random.default_rng(1234)
    shape = tuple(cfg.synthetic_shape)
    x = rng.standard_normal((cfg.synthetic_samples, *shape), dtype=np.float32)
    w = rng.standard_normal((int(np.prod(shape)), cfg.synthetic_classes), dtype=np.float32)
    y = np.argmax(x.reshape(len(x), -1) @ w, axis=1).astype(np.int64)
    return split(x, y, built_in_split(cfg))


def keras_dataset(name):
    def load_(cfg, _, need_classes):
        import tensorflow as tf

        try:
            (x, y), (xv, yv) = getattr(tf.keras.datasets, name).load_data()
        except (OSError, ValueError) as e:  # urllib's errors are OSErrors; a truncated file a ValueError
            raise UserError(f"--data {name}: could not download it ({type(e).__name__}); offline? "
                            f"Save it as npz (x, y, x_val, y_val) and use --data npz:PATH") from None
        x, xv = (a.astype(np.float32) / 255.0 for a in (x, xv))
        if x.ndim == 3:
            x, xv = x[..., None], xv[..., None]
        return x, y.reshape(-1).astype(np.int64), xv, yv.reshape(-1).astype(np.int64)
    return load_


BUILT_IN = {"digits": digits, "synthetic": synthetic, "mnist": keras_dataset("mnist"),
            "fashion_mnist": keras_dataset("fashion_mnist"), "cifar10": keras_dataset("cifar10")}


def built_in_split(cfg: Config) -> float:
    return BUILT_IN_VAL_SPLIT if cfg.val_split is None else cfg.val_split


def load_npz(cfg, path, need_classes):
    try:
        with np.load(path) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:  # missing, not npz, or corrupt
        raise UserError(f"--data npz:{path}: cannot read it as npz ({e})") from None
    for key in ("x", "y"):
        if key not in arrays:
            raise UserError(f"--data npz:{path}: no array '{key}' (has: {', '.join(arrays) or 'none'})")
    targets = (lambda y, what: labels(y, what, need_classes)) if need_classes else (lambda y, what: np.asarray(y))
    x, y = arrays["x"].astype(np.float32), targets(arrays["y"], f"npz:{path} y")
    if len(x) != len(y):
        raise UserError(f"--data npz:{path}: x has {len(x)} samples but y has {len(y)}")
    if "x_val" in arrays and "y_val" in arrays:
        return x, y, arrays["x_val"].astype(np.float32), targets(arrays["y_val"], f"npz:{path} y_val")
    return split(x, y, built_in_split(cfg))


def labels(y, what, need: str = "the built-in model"):
    """Class indices: integers >= 0 (a float label like 2.5 or a -1 would train on garbage)."""
    y = np.asarray(y).reshape(-1)
    if y.size and need.startswith("--model") and not np.issubdtype(y.dtype, np.integer) \
            and np.any(y != np.round(y)):
        raise UserError(f"{need} takes num_classes, which hvdtrain counts in the labels, but y is {y.dtype} "
                        f"(regression targets?): drop num_classes from the function's parameters, or give it "
                        f"with --num-classes N (hvdtrain.fit: num_classes=N)")
    if y.size and (not np.all(np.isfinite(y.astype(np.float64))) or np.any(y != np.round(y))):
        raise UserError(f"--data {what}: labels must be class indices (integers), got e.g. "
                        f"{y[np.flatnonzero(y != np.round(y))[:1]].tolist() or 'NaN'}")
    if y.size and y.min() < 0:
        raise UserError(f"--data {what}: labels must be >= 0, got {int(y.min())}")
    return y.astype(np.int64)
