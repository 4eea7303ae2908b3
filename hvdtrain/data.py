"""Data sources, and the shard of them that this worker reads.

Every source ends as one of three things: in-memory arrays, hvdtrain's own TFRecord files, or a
tf.data pipeline (yours). One rule then holds: each worker reads only its own shard, and every worker
runs the same number of steps per epoch, so an uneven split never leaves a rank waiting in an
allreduce (and the samples it leaves out are logged).

Your pipeline, `--data module:function` or `hvdtrain.fit(model, data)`:
- `def dataset(ctx)` gets this worker's `DataContext` (rank, workers, batch sizes, seed, `shard`) and
  returns a pipeline it already sharded, like tf.distribute's `dataset_fn(input_context)`;
- `def dataset()` (or a Dataset object) describes the whole data set and hvdtrain shards it: by file
  when the pipeline reads files and every worker gets at least one (TensorFlow's own auto-shard
  rewrite, as tf.distribute does), by element otherwise;
- it may return `(train, val)`; elements are whatever the model takes ((x, y), dicts, ...);
- batched or not is read from the pipeline; a batched one is taken as per-worker batches.

Shuffling is seeded by (seed, epoch), identical on every rank, and done *before* element sharding:
the union of the workers' batches at step k is then exactly the global batch one worker would see at
batch_size x workers, and a run resumed at epoch k sees the same order as an uninterrupted one.

A run resumed inside an epoch (a step checkpoint) starts that epoch at the next step, on the same
order, without reading what came before and dropping it: arrays skip index batches; `tfrecord:`
skips whole files, and inside a file the raw records up to the window it resumes in; a pipeline of
yours skips below its maps and batches (raw records are read, not parsed). Records are shuffled in
fixed windows (each a permutation drawn from (seed, epoch, window)), so a window can be rebuilt alone.
"""
from __future__ import annotations

import glob
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from . import compat, runtime
from .config import BUILT_IN_VAL_SPLIT, DEFAULT_BATCH_SIZE, Config, UserError
from .runtime import World

SPLIT_SEED = 0  # the train/validation split does not move with --seed, so runs stay comparable
WINDOW = 10_000  # records shuffled together (a shuffle buffer's worth; rebuilt alone on resume)


@dataclass
class Data:
    """What the trainer needs: this worker's training stream and the facts about it."""
    epoch: Optional[Callable]  # epoch -> batched dataset of this worker's shard; None: a continuous stream
    val: Optional["tf.data.Dataset"]  # this worker's part of the validation set, batched
    steps_per_epoch: int
    batch_size: int  # per worker
    element_spec: Any  # of one batch
    num_samples: Optional[int]  # training samples in the whole data set (None: not counted)
    sharding: str  # "element", "file", "batch", "yours" or "none"
    num_classes: Optional[int] = None  # asked of the data for the built-in models only
    continuous: Optional["tf.data.Dataset"] = None  # a repeating or infinite pipeline, batched
    notes: list = field(default_factory=list)  # lines rank 0 logs once
    unrepeatable: Optional[str] = None  # why an epoch's order cannot be reproduced (None: it can)

    def stream(self, first_epoch: int, epochs: int, skip: int = 0):
        """Epochs first_epoch..epochs-1 back to back, for model.fit(steps_per_epoch=...); the first one
        without its first `skip` steps (a run resumed inside an epoch)."""
        import tensorflow as tf

        if self.epoch is None:  # Keras keeps one iterator across epochs when steps are given
            return self.continuous.prefetch(tf.data.AUTOTUNE)
        ds = tf.data.Dataset.range(first_epoch + (1 if skip else 0), epochs).flat_map(self.epoch)
        if skip:
            ds = self.epoch(first_epoch, skip).concatenate(ds)
        return ds.prefetch(tf.data.AUTOTUNE)

    @property
    def input_shape(self):
        """The model's input shape, from the data: a tuple, or a dict/list of them for several inputs."""
        x = self.element_spec[0] if isinstance(self.element_spec, tuple) else self.element_spec
        import tensorflow as tf

        return tf.nest.map_structure(lambda s: tuple(s.shape[1:]), x)


@dataclass
class DataContext:
    """What `def dataset(ctx)` learns about its worker. It also answers to the names of
    tf.distribute.InputContext, so a tf.distribute `dataset_fn(input_context)` works unchanged."""
    rank: int
    num_workers: int
    local_rank: int
    batch_size: int  # per worker
    seed: int

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.num_workers

    # tf.distribute.InputContext
    @property
    def num_input_pipelines(self) -> int:
        return self.num_workers

    @property
    def input_pipeline_id(self) -> int:
        return self.rank

    @property
    def num_replicas_in_sync(self) -> int:
        return self.num_workers

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        if global_batch_size % self.num_workers:
            raise ValueError(f"global batch size {global_batch_size} is not divisible by "
                             f"{self.num_workers} workers")
        return global_batch_size // self.num_workers

    def shard(self, ds):
        """This worker's shard of `ds`: by file when it reads files and every worker gets one, else by
        element (the same rule hvdtrain applies to a pipeline it shards itself)."""
        return shard(ds, self.rank, self.num_workers)[0]


def load(cfg: Config, world: World, source=None, validation=None, need_classes: Optional[str] = None) -> Data:
    """This worker's Data from `source` (a --data string, a function, a Dataset or arrays; default
    cfg.data). need_classes: what needs the number of classes from the labels (a built-in model, a
    model function that takes num_classes), or None."""
    source = cfg.data if source is None else source
    if isinstance(source, str):
        kind, _, arg = source.partition(":")
        if kind == "tfrecord":
            return _from_tfrecords(cfg, world, arg)
        if kind in _ARRAY_SOURCES:
            return _from_arrays(cfg, world, *_ARRAY_SOURCES[kind](cfg, arg, need_classes))
        if kind == "npz":
            return _from_arrays(cfg, world, *_load_npz(cfg, arg, need_classes))
        source = resolve(source, "--data")
    name = cfg.data
    user_shards = False
    if callable(source) and not _is_dataset(source):
        source, user_shards = _call_data_function(source, cfg, world)
    if validation is None and isinstance(source, (tuple, list)) and len(source) == 2 \
            and all(_is_dataset(d) or _is_sequence(d) for d in source):
        source, validation = source
    if _is_sequence(source):
        return _from_sequence(cfg, world, source, validation, need_classes)
    if _is_dataset(source):
        if validation is not None and not _is_dataset(validation):
            validation = _dataset_from_arrays(validation, name)
        return _from_pipeline(cfg, world, name, source, validation, user_shards, need_classes)
    if isinstance(source, (tuple, list)) and len(source) == 2:  # (x, y) arrays
        x, y = source
        xv, yv = validation if validation is not None else (None, None)
        if validation is None and cfg.val_split:
            x, y, xv, yv = _split(x, y, cfg.val_split)
        return _from_arrays(cfg, world, x, y, xv, yv)
    raise UserError(f"--data {name}: expected a tf.data.Dataset or a keras.utils.Sequence (or a (train, val) "
                    f"pair of them), or (x, y) arrays, got {type(source).__name__}")


def _is_dataset(obj) -> bool:
    import tensorflow as tf

    return isinstance(obj, tf.data.Dataset)


def _is_sequence(obj) -> bool:
    """A keras.utils.Sequence (Keras 3: PyDataset, of which Sequence is another name)."""
    import tensorflow as tf

    return isinstance(obj, tf.keras.utils.Sequence)


# ---------------------------------------------------------------- a keras.utils.Sequence (PyDataset)

def _from_sequence(cfg: Config, world: World, seq, validation, need_classes: Optional[str]) -> Data:
    """Each worker takes its own batches by index: the epoch's order of all batches (a permutation
    drawn from (seed, epoch) when shuffling, as Keras' fit shuffles a Sequence's batches), then
    every size-th from this rank's. Batches are read by __getitem__ only as training reaches them
    (a resume skips indices, not data), and on_epoch_end runs after each epoch, as in Keras' fit;
    a resumed run calls it for the epochs it skips, so a Sequence that reshuffles there does again."""
    import tensorflow as tf

    n = len(seq)
    steps, notes = _agree_steps(cfg, world, runtime.gather((n - world.rank + world.size - 1) // world.size),
                                1, n, unit="batches")
    first = _as_batch(seq[0], "the Sequence")
    spec = _batch_spec(first)
    ended, before = [0], compat.sequence_epoch_ends_before_training()  # on_epoch_end calls: made, and owed

    def order(e):
        return np.asarray(_permutation(n, _epoch_seed(cfg.seed, e), 0)) if cfg.shuffle else np.arange(n)

    def batches(e, skip):
        e, skip = int(e), int(skip)
        while ended[0] < e + before:  # a resumed run: the epochs before it, ended as they were
            seq.on_epoch_end()
            ended[0] += 1
        if hasattr(seq, "on_epoch_begin"):  # Keras 3's PyDataset
            seq.on_epoch_begin()
        mine = order(e)[world.rank::world.size][:steps]
        for k in range(skip, steps):
            item = _as_batch(seq[int(mine[k])], "the Sequence")
            if k == steps - 1:  # Keras reads no further than the epoch's last batch: end it here
                seq.on_epoch_end()
                ended[0] += 1
            yield item

    def epoch(e, skip=0):
        return tf.data.Dataset.from_generator(batches, output_signature=spec, args=(e, skip))

    val = None
    if validation is not None:
        if not _is_sequence(validation):
            raise UserError(f"--data {cfg.data}: with a Sequence for training, validation data must be a "
                            f"Sequence too, got {type(validation).__name__}")
        mine = range(world.rank, len(validation), world.size)
        val = tf.data.Dataset.from_generator(
            lambda: (_as_batch(validation[i], "the validation Sequence") for i in mine),
            output_signature=_batch_spec(_as_batch(validation[0], "the validation Sequence")))
        val = val.apply(tf.data.experimental.assert_cardinality(len(mine)))
    classes = None
    if need_classes:
        labels = [np.asarray(tf.nest.flatten(_as_batch(seq[i], "the Sequence")[1])[0]) for i in range(n)]
        classes = labels[0].shape[1] if labels[0].ndim == 2 else int(max(l.max() for l in labels)) + 1
    batch = len(tf.nest.flatten(first)[0])
    return Data(epoch, val, steps, batch, spec, None, "batch", classes, notes=notes)


def _batch_spec(batch):
    """tf.data's signature of a Sequence's batches, from one: any batch size, the rest as it is."""
    import tensorflow as tf

    return tf.nest.map_structure(lambda a: tf.TensorSpec((None, *a.shape[1:]), tf.as_dtype(a.dtype)), batch)


def _as_batch(item, what: str):
    """A Sequence's item as tf.data takes it: (x, y) or (x, y, w) as a tuple, arrays as numpy."""
    import tensorflow as tf

    if isinstance(item, list):
        item = tuple(item)
    if not isinstance(item, tuple) or len(item) not in (1, 2, 3):
        raise UserError(f"{what}: __getitem__ must return (x, y) or (x, y, sample_weight), "
                        f"got {type(item).__name__}")
    return tf.nest.map_structure(np.asarray, item)


def _call_data_function(fn, cfg: Config, world: World):
    """Call `dataset(ctx)` or `dataset()`; returns (what it made, whether it sharded itself)."""
    try:
        takes_ctx = len(inspect.signature(fn).parameters) > 0
    except (TypeError, ValueError):
        takes_ctx = False
    if not takes_ctx:
        return fn(), False
    ctx = DataContext(rank=world.rank, num_workers=world.size, local_rank=world.local_rank,
                      batch_size=cfg.batch_size or DEFAULT_BATCH_SIZE, seed=cfg.seed)
    return fn(ctx), True


# ---------------------------------------------------------------- sources that fit in memory

def _digits(cfg, _, need_classes):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[..., None]
    return _split(x, d.target.astype(np.int64), _built_in_split(cfg))


def _synthetic(cfg, _, need_classes):
    """Random inputs with learnable labels (a fixed random linear map), the same on every rank."""
    rng = np.random.default_rng(1234)
    shape = tuple(cfg.synthetic_shape)
    x = rng.standard_normal((cfg.synthetic_samples, *shape), dtype=np.float32)
    w = rng.standard_normal((int(np.prod(shape)), cfg.synthetic_classes), dtype=np.float32)
    y = np.argmax(x.reshape(len(x), -1) @ w, axis=1).astype(np.int64)
    return _split(x, y, _built_in_split(cfg))


def _keras_dataset(name):
    def load_(cfg, _, need_classes):
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


def _built_in_split(cfg: Config) -> float:
    return BUILT_IN_VAL_SPLIT if cfg.val_split is None else cfg.val_split


def _load_npz(cfg, path, need_classes):
    try:
        with np.load(path) as f:
            arrays = {k: f[k] for k in f.files}
    except Exception as e:
        raise UserError(f"--data npz:{path}: cannot read it as npz ({e})") from None
    for key in ("x", "y"):
        if key not in arrays:
            raise UserError(f"--data npz:{path}: no array '{key}' (has: {', '.join(arrays) or 'none'})")
    targets = (lambda y, what: _labels(y, what, need_classes)) if need_classes else (lambda y, what: np.asarray(y))
    x, y = arrays["x"].astype(np.float32), targets(arrays["y"], f"npz:{path} y")
    if len(x) != len(y):
        raise UserError(f"--data npz:{path}: x has {len(x)} samples but y has {len(y)}")
    if "x_val" in arrays and "y_val" in arrays:
        return x, y, arrays["x_val"].astype(np.float32), targets(arrays["y_val"], f"npz:{path} y_val")
    return _split(x, y, _built_in_split(cfg))


def _labels(y, what, need: str = "the built-in model"):
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


def _split(x, y, val_split):
    """A fixed random split (SPLIT_SEED) of arrays, or of dicts/lists of arrays."""
    import tensorflow as tf

    n = len(tf.nest.flatten(y)[0])
    order = np.random.default_rng(SPLIT_SEED).permutation(n)
    n_val = int(round(n * (val_split or 0)))
    val, train = order[:n_val], order[n_val:]
    take = lambda a, idx: tf.nest.map_structure(lambda v: np.asarray(v)[idx], a)
    return take(x, train), take(y, train), take(x, val), take(y, val)


def _from_arrays(cfg: Config, world: World, x, y, xv, yv) -> Data:
    """Shuffle the indices, shard them, gather the batches: the arrays are never copied per epoch."""
    import tensorflow as tf

    batch = cfg.batch_size or DEFAULT_BATCH_SIZE
    n = len(tf.nest.flatten(y)[0])
    steps, notes = _agree_steps(cfg, world, runtime.gather(_shard_size(n, world)), batch, n)
    xt, yt = tf.nest.map_structure(tf.constant, x), tf.nest.map_structure(tf.constant, y)
    take = steps * batch

    def epoch(e, skip=0):
        # stateless: shuffle(seed=a tensor) fails to trace under the global seed 0 (--seed 0)
        idx = tf.data.Dataset.from_tensor_slices(_permutation(n, _epoch_seed(cfg.seed, e), 0)) if cfg.shuffle \
            else tf.data.Dataset.range(n)
        return (idx.shard(world.size, world.rank).take(take)
                .batch(batch, drop_remainder=True).skip(skip)  # indices only: a resume reads no data
                .map(lambda i: tf.nest.map_structure(lambda a: tf.gather(a, i), (xt, yt))))

    val = None
    if xv is not None and len(tf.nest.flatten(yv)[0]):
        val = tf.data.Dataset.from_tensor_slices((xv, yv)).shard(world.size, world.rank).batch(batch)
    classes, labels = None, np.asarray(tf.nest.flatten(y)[0])
    if labels.ndim == 2:  # one-hot
        classes = labels.shape[1]
    elif np.issubdtype(labels.dtype, np.integer):
        classes = max(int(np.max(a, initial=0)) for a in (labels, *tf.nest.flatten(yv)[:1])
                      if a is not None) + 1
    return Data(epoch, val, steps, batch, epoch(0).element_spec, n, "element", classes, notes=notes)


def _dataset_from_arrays(pair, name):
    import tensorflow as tf

    if isinstance(pair, (tuple, list)) and len(pair) == 2:
        return tf.data.Dataset.from_tensor_slices(tuple(pair))
    raise UserError(f"--data {name}: validation data must be a tf.data.Dataset or (x, y) arrays, "
                    f"got {type(pair).__name__}")


def _shard_size(n: int, world: World) -> int:
    return (n - world.rank + world.size - 1) // world.size


def _epoch_seed(seed, epoch):
    """A tf.data seed from (seed, epoch): the same on every rank, different every epoch."""
    import tensorflow as tf

    return tf.cast(seed, tf.int64) * 1_000_003 + tf.cast(epoch, tf.int64)


def _permutation(n, seed, salt):
    """A permutation of range(n) drawn from (seed, salt): the same in a graph and eagerly."""
    import tensorflow as tf

    return tf.random.experimental.stateless_shuffle(
        tf.range(tf.cast(n, tf.int64)), seed=tf.stack([tf.cast(seed, tf.int64), tf.cast(salt, tf.int64)]))


def _window_shuffle(ds, seed, first_window: int = 0):
    """Shuffle within consecutive windows of WINDOW elements, window i by the permutation of (seed, i):
    a run resumed inside an epoch rebuilds its window alone, where a shuffle buffer would need every
    element before it."""
    import tensorflow as tf

    def shuffle(i, window):
        order = _permutation(tf.shape(tf.nest.flatten(window)[0])[0], seed, i)
        return tf.nest.map_structure(lambda t: tf.gather(t, order), window)

    return ds.batch(WINDOW).enumerate(first_window).map(shuffle).unbatch()


def _agree_steps(cfg: Config, world: World, shard_sizes: list, batch: int, total: int, unit="samples"):
    """Steps per epoch every rank can run: the smallest shard decides (--steps-per-epoch caps it).

    shard_sizes: every rank's shard, in samples (or batches for a batched pipeline, batch=1).
    Returns (steps, notes): the notes say what each rank leaves out of every epoch.
    """
    if total == 0:
        raise UserError(f"--data {cfg.data}: the data set is empty")
    steps = min(shard_sizes) // batch
    if steps == 0:
        what = f"workers x batch size = {world.size} x {batch}" if unit == "samples" else \
            f"the {world.size} workers (one batch each)"
        raise UserError(f"--data {cfg.data}: {total} training {unit} is fewer than {what}; "
                        f"lower --batch-size or use fewer workers")
    notes = []
    if cfg.steps_per_epoch and cfg.steps_per_epoch < steps:
        return cfg.steps_per_epoch, notes
    left = [s - steps * batch for s in shard_sizes]
    if any(left):
        per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(left) if n)
        notes.append(f"{steps} steps per epoch on every worker (the smallest shard decides); {unit} "
                     f"left out of each epoch: {per_rank}" +
                     (" (a different set every epoch: the order is reshuffled)" if cfg.shuffle and
                      unit == "samples" else ""))
    return steps, notes


# ---------------------------------------------------------------- hvdtrain's own TFRecord files

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


def _scan(files):
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


def _records_from(names, counts, start: int):
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


def _from_tfrecords(cfg: Config, world: World, pattern: str) -> Data:
    import tensorflow as tf

    files = sorted(glob.glob(pattern))
    if not files:
        raise UserError(f"--data tfrecord:{pattern}: no files match")
    batch = cfg.batch_size or DEFAULT_BATCH_SIZE
    by_file = len(files) >= world.size
    mine = files[world.rank::world.size] if by_file else files  # fewer files than workers: all, by element
    counts, top = _scan(mine)
    count = int(counts.sum()) if by_file else _shard_size(int(counts.sum()), world)
    counts_tops = runtime.gather((count, top))
    total = sum(c for c, _ in counts_tops)  # shards are disjoint either way
    steps, notes = _agree_steps(cfg, world, [c for c, _ in counts_tops], batch, total)
    classes = max(t for _, t in counts_tops) + 1
    first = next(iter(tf.data.TFRecordDataset(files[:1]).take(1)))
    shape = tuple(tf.io.parse_tensor(tf.io.parse_single_example(
        first, {"x": tf.io.FixedLenFeature([], tf.string)})["x"], tf.float32).shape)
    parse = _parse_fn(shape)
    take = steps * batch
    stride = 1 if by_file else world.size  # records of all files per record of mine

    def file_order(e):
        if not cfg.shuffle:
            return tf.range(len(mine), dtype=tf.int64)
        return _permutation(len(mine), _epoch_seed(cfg.seed, e), -1)

    def epoch(e, skip=0):
        """My files in this epoch's order, read one after another; the records shuffled in windows;
        parsed last, so that what a resume skips is never parsed."""
        order = file_order(e)
        names = tf.gather(tf.constant(mine), order)
        window, start = divmod(skip * batch, WINDOW)  # resume in this window of my records, at this place
        if skip:
            records = _records_from(names.numpy(), counts[order.numpy()], window * WINDOW * stride)
        else:
            records = tf.data.TFRecordDataset(names)
        if not by_file:
            records = records.shard(world.size, world.rank)
        if cfg.shuffle:
            records = _window_shuffle(records, _epoch_seed(cfg.seed, e), window)
        return (records.take(take - window * WINDOW).skip(start)
                .map(parse, num_parallel_calls=tf.data.AUTOTUNE)
                .batch(batch, drop_remainder=True))

    return Data(epoch, None, steps, batch, epoch(0).element_spec, total, "file" if by_file else "element",
                classes, notes=notes)


# ---------------------------------------------------------------- a tf.data pipeline (yours)

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


# tf.data's Python classes, by what they do to the elements that pass through (TensorFlow 2.15)
_ONE_TO_ONE = {"_MapDataset", "_ParallelMapDataset", "_PrefetchDataset", "_ShuffleDataset",
               "_OptionsDataset", "CacheDataset", "_AssertCardinalityDataset"}
_KEEP_BATCHING = _ONE_TO_ONE | {"_FilterDataset", "_TakeDataset", "_SkipDataset", "_RepeatDataset",
                                "_ShardDataset", "_IgnoreErrorsDataset", "_TakeWhileDataset"}
_BATCHERS = {"_BatchDataset", "_ParallelBatchDataset", "_PaddedBatchDataset", "_RebatchDataset",
             "_DenseToRaggedDataset", "_DenseToSparseBatchDataset"}


def _upstream(ds, through: set):
    """ds, then what it reads from, for as long as each step is one of `through` (by class name)."""
    while True:
        yield ds
        if compat.stage(ds) not in through or compat.stage_input(ds) is None:
            return
        ds = compat.stage_input(ds)


def batching(ds):
    """(batched, batch size or None) of a pipeline.

    The pipeline's own last batch/unbatch decides when tf.data's Python objects show it; otherwise the
    element_spec does: a scalar component cannot be a batch, and a leading dimension unknown in every
    component is one.
    """
    import tensorflow as tf

    for d in _upstream(ds, _KEEP_BATCHING):
        name = compat.stage(d)
        if name in _BATCHERS:
            return True, compat.batch_of(d)[0]
        if name == "_UnbatchDataset":
            return False, None
    shapes = [s.shape for s in tf.nest.flatten(ds.element_spec) if hasattr(s, "shape")]
    if not shapes or any(s.rank == 0 for s in shapes):
        return False, None
    leading = {s[0] if s.rank else None for s in shapes}
    if leading == {None}:
        return True, None
    return False, None


def _hold_out(ds, fraction: float, name: str):
    """(train, val): every element whose position i has floor((i+1) f) > floor(i f) is validation,
    so exactly floor(n f) of n are, with no pass to count them and the same split every epoch."""
    import tensorflow as tf

    if ds.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise UserError(f"--val-split cannot split {name}: it is infinite (it repeats); return "
                        f"(train, val) from it instead")
    why = unrepeatable(ds)
    if why:
        raise UserError(f"--val-split cannot split {name}: {why}, so a held-out "
                        f"part would change and leak into training; return (train, val) instead (e.g. "
                        f"image_dataset_from_directory(validation_split=..., subset='both', seed=...))")
    def is_val(i, *_):
        f = tf.constant(fraction, tf.float64)
        return tf.floor(tf.cast(i + 1, tf.float64) * f) > tf.floor(tf.cast(i, tf.float64) * f)

    def is_train(i, *element):
        return tf.logical_not(is_val(i))

    def element(i, *rest):
        return rest[0] if len(rest) == 1 else rest

    pos = ds.enumerate()
    train, val = pos.filter(is_train).map(element), pos.filter(is_val).map(element)
    n = int(ds.cardinality())
    if n >= 0:  # known: keep it known, so no count is needed later
        n_val = int(np.floor(n * fraction))
        train = train.apply(tf.data.experimental.assert_cardinality(n - n_val))
        val = val.apply(tf.data.experimental.assert_cardinality(n_val))
    return train, val


_SHARDABLE_READERS = {"TFRecordDataset", "TextLineDataset", "FixedLengthRecordDataset"}  # what FILE rewrites
_READERS = _SHARDABLE_READERS | {"CSVDataset", "SqlDataset"}


def _in_graph(ds, names=_READERS) -> set:
    """Which datasets of `names` (by default: file readers) a pipeline's graph holds, including
    inside interleave/flat_map functions."""
    import re

    graph = compat.graph_bytes(ds)
    return {name for name in names if re.search(rb"(?<![A-Za-z])" + name.encode() + rb"(V\d)?(?![A-Za-z])", graph)}


def _under_the_maps(ds):
    """The pipeline below its one-to-one steps (map, prefetch, shuffle): the same count, no parsing."""
    return list(_upstream(ds, _ONE_TO_ONE))[-1]


def shard(ds, rank: int, workers: int):
    """(this worker's shard of ds, a pipeline with the same count that skips the parsing, "file",
    "element" or "batch" (element sharding of a batched pipeline, whose elements are batches), why not
    by file or None, in those same words).

    By file when the pipeline reads files and every worker's share of them holds data: TensorFlow's
    auto-shard rewrite (what tf.distribute does) inserts the shard in front of the reader. tf.data's
    FILE policy would leave a worker with nothing when there are fewer files than workers, so that case
    falls back to element sharding (every worker reads everything and keeps every Nth element). A
    pipeline whose options say AutoShardPolicy.DATA is sharded by element, OFF not at all.
    """
    import tensorflow as tf

    reader = _under_the_maps(ds)
    policy = ds.options().experimental_distribute.auto_shard_policy
    if workers == 1 or policy == tf.data.experimental.AutoShardPolicy.OFF:
        return ds, reader, "none", None
    unit, units = ("batch", "batches") if batching(ds)[0] else ("element", "elements")
    by_element = (ds.shard(workers, rank), reader.shard(workers, rank), unit)
    if policy == tf.data.experimental.AutoShardPolicy.DATA:
        return (*by_element, None)
    reads = _in_graph(ds)
    # asked anyway, TensorFlow's rewrite logs a 100-line error before it gives up
    if not reads & _SHARDABLE_READERS:
        why = (f"its reader ({', '.join(sorted(reads))}) cannot be sharded by file by TensorFlow: sharded "
               f"by {unit} instead, so every worker reads every file") if reads else None
        return (*by_element, why)
    if _in_graph(ds, {"RangeDataset"}):  # a source the rewrite cannot walk past
        return (*by_element, f"it numbers its {units} (enumerate, as --val-split does), which TensorFlow "
                             f"cannot shard by file: sharded by {unit} instead, so every worker reads every file")
    try:
        by_file = _auto_sharded(ds, workers, rank)
    except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError):
        return (*by_element, None)  # no file reader at the source of the pipeline
    my_reader = _auto_sharded(reader, workers, rank)
    try:
        nothing = next(iter(my_reader.take(1)), None) is None
    except tf.errors.InvalidArgumentError:  # "the dataset only has 1 file(s), which is not enough"
        nothing = True
    empty = runtime.gather(int(nothing))
    if any(empty):
        why = (f"it reads fewer files than the {workers} workers: sharded by {unit} instead, so every "
               f"worker reads every file")
        return (*by_element, why)
    return by_file, my_reader, "file", None


def _count(ds, name: str) -> int:
    """Elements of a finite pipeline (this worker's shard): its cardinality, or one pass over it."""
    import tensorflow as tf

    n = int(ds.cardinality())
    if n >= 0:
        return n
    try:
        return int(ds.reduce(np.int64(0), lambda c, _: c + 1))
    except tf.errors.OpError as e:
        raise UserError(f"--data {name}: reading it failed ({e.message.splitlines()[0][:300]})") from None


def _num_classes(ds, batched: bool, name: str, need: str = "the built-in model") -> int:
    """For the built-in models and functions that take num_classes (`need` says which): one-hot (or
    multi-hot) labels say it in their last dimension; class indices by their largest value (one
    pass over my shard, timed and said: --num-classes skips it)."""
    import time

    import tensorflow as tf

    spec = ds.element_spec
    if not (isinstance(spec, tuple) and len(spec) >= 2 and hasattr(spec[1], "dtype")):
        raise UserError(f"--data {name}: num_classes comes from (x, y) elements, whose y holds class "
                        f"indices or one-hot rows")
    label_rank = spec[1].shape.rank - (1 if batched else 0)
    if label_rank >= 1 and spec[1].shape[-1] is not None:
        return int(spec[1].shape[-1])
    if not spec[1].dtype.is_integer and need.startswith("--model"):
        raise UserError(f"{need} takes num_classes, which hvdtrain counts in the labels, but y is "
                        f"{spec[1].dtype.name} (regression targets?): drop num_classes from the function's "
                        f"parameters, or give it with --num-classes N (hvdtrain.fit: num_classes=N)")
    if not spec[1].dtype.is_integer:
        raise UserError(f"--data {name}: the built-in models classify, so y must be integer class "
                        f"indices (or one-hot rows), got {spec[1].dtype.name}; bring your own model "
                        f"(--model module:function) for regression")
    t0 = time.perf_counter()
    top = int(ds.map(lambda *e: tf.cast(tf.reduce_max(e[1]), tf.int64)).reduce(np.int64(-1), tf.maximum))
    classes = max(runtime.gather(top)) + 1
    runtime.log.info("num_classes for %s: %d, counted in one pass over the data (%.1f s); --num-classes %d "
                     "(hvdtrain.fit: num_classes=%d) skips it", need, classes, time.perf_counter() - t0,
                     classes, classes)
    return classes


def _from_pipeline(cfg: Config, world: World, name: str, train, val, user_shards: bool,
                   need_classes: bool) -> Data:
    import tensorflow as tf

    batched, own_batch = batching(train)
    notes = []
    if batched:
        batch = own_batch or _peek_batch_size(train)
        if cfg.batch_size and cfg.batch_size != batch:
            notes.append(f"{name} is batched by {batch} per worker, so that is the batch size; "
                         f"--batch-size {cfg.batch_size} is not used")
    else:
        batch = cfg.batch_size or DEFAULT_BATCH_SIZE
    if val is None and cfg.val_split:
        train, val = _hold_out(train, cfg.val_split, name)
        notes.append(f"validation: {cfg.val_split:g} of {name} held out by position (--val-split), "
                     f"the same {'batches' if batched else 'elements'} every epoch")

    # shard (unless the function did), then agree on the steps
    if user_shards:
        how, why = "yours", None
        pre, post, countable = train, (lambda ds: ds), _under_the_maps(train)
    else:
        sharded, countable, how, why = shard(train, world.rank, world.size)
        if how == "file":  # shuffle after sharding: each worker shuffles its own records
            pre, post = sharded, (lambda ds: ds)
        elif how in ("element", "batch"):  # shuffle before: every rank shuffles the same way, keeps its part
            pre, post = train, (lambda ds: ds.shard(world.size, world.rank))
        else:
            pre, post = train, (lambda ds: ds)
        if why:
            notes.append(f"{name}: {why}")
    if val is not None:
        val = val if batching(val)[0] else val.batch(batch)
        if not user_shards and world.size > 1:
            val = shard(val, world.rank, world.size)[0]

    mine = post(pre)
    cardinality = int(mine.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY or (cardinality < 0 and cfg.steps_per_epoch):
        if not cfg.steps_per_epoch:
            raise UserError(f"--data {name} is infinite (it repeats): give --steps-per-epoch N, the "
                            f"steps that make one epoch, or make it finite (make_csv_dataset and "
                            f"make_batched_features_dataset repeat unless num_epochs=1)")
        notes.append(f"{name} is {'infinite' if cardinality == tf.data.INFINITE_CARDINALITY else 'of unknown size'}"
                     f": each epoch is --steps-per-epoch {cfg.steps_per_epoch} steps of one stream "
                     f"that goes on across epochs")
        stream = mine.repeat() if batched else mine.repeat().batch(batch, drop_remainder=True)
        classes = _classes(need_classes, mine.take(cfg.steps_per_epoch * (1 if batched else batch)),
                           batched, name)
        return Data(None, val, cfg.steps_per_epoch, batch, stream.element_spec, None, how, classes,
                    continuous=stream, notes=notes)

    sizes = runtime.gather(cardinality if cardinality >= 0 else _count(countable, name))
    unit = "batches" if batched else "samples"
    steps, more = _agree_steps(cfg, world, sizes, 1 if batched else batch, sum(sizes), unit)
    classes = _classes(need_classes, mine, batched, name)
    take = steps if batched else steps * batch

    # A resume at step k: element (and batch) sharding shuffles and shards after the pipeline, so the
    # pipeline is then `stride` times further on than my shard
    stride = world.size if how in ("element", "batch") else 1

    def resumed(count):
        """`pre`, `count` elements on (by file: counted in this worker's files)."""
        if how == "file":
            return _auto_sharded(skip_cheaply(train, count), world.size, world.rank) if count else pre
        return skip_cheaply(pre, count)

    def epoch(e, skip=0):
        if batched:
            return post(resumed(skip * stride)).take(take - skip)
        if cfg.shuffle:
            window, start = divmod(skip * batch * stride, WINDOW)
            ds = _window_shuffle(resumed(window * WINDOW), _epoch_seed(cfg.seed, e), window).skip(start)
        else:
            ds = resumed(skip * batch * stride)
        return post(ds).take(take - skip * batch).batch(batch, drop_remainder=True)

    total = None if batched else sum(sizes)
    return Data(epoch, val, steps, batch, epoch(0).element_spec, total, how, classes,
                notes=notes + more, unrepeatable=unrepeatable(train))


def _auto_sharded(ds, workers: int, rank: int):
    """ds sharded by file, by TensorFlow's FILE rewrite (what tf.distribute does): the shard goes in
    front of the reader, so a skip inserted above the reader skips records of this worker's files."""
    return compat.shard_files(ds, workers, rank)


_REBUILT = {"_MapDataset", "_ParallelMapDataset", "_PrefetchDataset", "_BatchDataset"}


def skip_cheaply(ds, n: int):
    """ds.skip(n), with the skip moved below the pipeline's own maps and batches (rebuilt above it
    from their traced functions): what is skipped is read, but not parsed or decoded."""
    import tensorflow as tf

    if not n:
        return ds
    stages, below, count = [], ds, n
    while compat.stage(below) in _REBUILT:
        stages.append(below)
        if compat.stage(below) == "_BatchDataset":  # every batch before the resume point is full
            count *= compat.batch_of(below)[0]
        below = compat.stage_input(below)
    try:
        out = below.skip(count)
        for stage in reversed(stages):
            out = _again(stage, out)
        if out.element_spec != ds.element_spec:
            raise ValueError(f"{out.element_spec} != {ds.element_spec}")
        return out
    except Exception as e:  # a stage tf.data does not let us rebuild: skip the slow way
        runtime.log.info("resuming inside an epoch: skipping %d elements of the pipeline by reading "
                         "them (%s: %s)", n, type(e).__name__, str(e)[:200])
        return ds.skip(n)


def _again(stage, ds):
    """One stage of a pipeline (map, batch, prefetch) applied again, to another input."""
    import tensorflow as tf

    name = compat.stage(stage)
    if name == "_PrefetchDataset":
        return ds.prefetch(tf.data.AUTOTUNE)
    if name == "_BatchDataset":
        size, drop = compat.batch_of(stage)
        return ds.batch(size, drop_remainder=drop)
    return compat.map_again(stage, ds, tf.data.AUTOTUNE if name == "_ParallelMapDataset" else None)


def unrepeatable(ds) -> Optional[str]:
    """Why the order of a pipeline cannot be reproduced by a fresh process (None: it can)."""
    seen, todo = set(), [ds]
    if ds.options().deterministic is False:
        return "its options say deterministic=False"
    while todo:
        d = todo.pop()
        if id(d) in seen:
            continue
        seen.add(id(d))
        name = compat.stage(d)
        if name == "_ShuffleDataset" and compat.reshuffles(d):
            return ("it reshuffles every epoch (shuffle(..., reshuffle_each_iteration=True), the default; "
                    "give reshuffle_each_iteration=False, or return it unshuffled and unbatched: hvdtrain then "
                    "shuffles it, the same way in every run)")
        if compat.nondeterministic(d):
            return f"it runs {name.strip('_')} with deterministic=False"
        todo.extend(compat.stage_inputs(d))
    return None


def _classes(need: Optional[str], ds, batched: bool, name: str) -> Optional[int]:
    """num_classes, counted from the labels when `need` (what needs it) says so, else None."""
    return _num_classes(ds, batched, name, need) if need else None


def _peek_batch_size(ds) -> int:
    """A batched pipeline whose batch size tf.data does not say: look at its first batch."""
    import tensorflow as tf

    first = next(iter(ds.take(1)), None)
    if first is None:
        return DEFAULT_BATCH_SIZE
    return int(tf.nest.flatten(first)[0].shape[0])
