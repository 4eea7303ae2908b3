"""The adapter for a tf.data pipeline of the user's: `--data module:function`, a Dataset given to
hvdtrain.fit, or a function's (train, val) pair of them.

- `def dataset(ctx)` shards itself (ctx: this worker's DataContext), like tf.distribute's
  `dataset_fn(input_context)`; `def dataset()` (or a Dataset object) describes the whole data set and
  hvdtrain shards it: by file when the pipeline reads files and every worker gets at least one
  (TensorFlow's own auto-shard rewrite, as tf.distribute does), by element otherwise;
- batched or not is read from the pipeline; a batched one is taken as per-worker batches;
- an unbatched one is shuffled here, seeded by (seed, epoch), before element sharding;
- a resume skips below the pipeline's own maps and batches (raw records are read, not parsed).
The pipeline's stages are read through compat.py (tf.data has no public API for them).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from .. import compat, runtime
from ..config import DEFAULT_BATCH_SIZE, Config, Sharding, UserError
from ..runtime import World, log
from . import agree
from .core import WINDOW, Data, epoch_seed, window_shuffle


class Pipeline:
    """Shard (unless the function did), count, agree on the steps; an epoch then shuffles (unbatched),
    takes this worker's part and batches, from any step on."""

    @staticmethod
    def can_handle(source) -> bool:
        import tensorflow as tf

        return isinstance(source, tf.data.Dataset)

    def __init__(self, cfg: Config, world: World, name: str, train, val, user_shards: bool, need_classes):
        self.cfg, self.world, self.name, self.train, self.val = cfg, world, name, train, val
        self.user_shards, self.need_classes, self.notes = user_shards, need_classes, []
        self.batched, own_batch = batching(train)
        if self.batched:
            self.batch = own_batch or peek_batch_size(train)
            if cfg.batch_size and cfg.batch_size != self.batch:
                self.notes.append(f"{name} is batched by {self.batch} per worker, so that is the batch size; "
                                  f"--batch-size {cfg.batch_size} is not used")
        else:
            self.batch = cfg.batch_size or DEFAULT_BATCH_SIZE
        if val is None and cfg.val_split:
            self.train, self.val = hold_out(train, cfg.val_split, name)
            self.notes.append(f"validation: {cfg.val_split:g} of {name} held out by position (--val-split), "
                              f"the same {'batches' if self.batched else 'elements'} every epoch")

    def shard(self):
        """How this worker takes its part: `pre` is what an epoch starts from, `post` what it applies
        after shuffling (element sharding: every rank shuffles the same way, then keeps its part; by
        file: each worker shuffles its own records), `countable` counts the shard without parsing."""
        world, train = self.world, self.train
        self.post = lambda ds: ds
        if self.user_shards:
            self.how, self.pre, self.countable = Sharding.YOURS, train, records_under(train)
            return
        sharded, self.countable, self.how, why = shard(train, world.rank, world.size)
        self.pre = sharded if self.how == Sharding.FILE else train
        if self.how in (Sharding.ELEMENT, Sharding.BATCH):
            self.post = lambda ds: ds.shard(world.size, world.rank)
        if why:
            self.notes.append(f"{self.name}: {why}")

    def count(self) -> int:
        """This worker's batches (batched) or elements: the pipeline's cardinality, or one pass."""
        cardinality = int(self.mine.cardinality())
        return cardinality if cardinality >= 0 else self.countable.count(self.name)

    def resumed(self, count: int):
        """`pre`, `count` elements on (by file: counted in this worker's files), skipped cheaply."""
        if self.how == Sharding.FILE:
            return auto_sharded(skip_cheaply(self.train, count), self.world.size, self.world.rank) if count \
                else self.pre
        return skip_cheaply(self.pre, count)

    def epoch(self, e, skip=0):
        """Epoch e of this worker's shard, batched, from its `skip`-th batch on. Element (and batch)
        sharding shuffles and shards after the pipeline, so at step k the pipeline is `stride` times
        further on than this worker's shard."""
        cfg, batch, post = self.cfg, self.batch, self.post
        stride = self.world.size if self.how in (Sharding.ELEMENT, Sharding.BATCH) else 1
        if self.batched:
            return post(self.resumed(skip * stride)).take(self.steps - skip)
        if cfg.shuffle:
            window, start = divmod(skip * batch * stride, WINDOW)
            ds = window_shuffle(self.resumed(window * WINDOW), epoch_seed(cfg.seed, e), window).skip(start)
        else:
            ds = self.resumed(skip * batch * stride)
        return post(ds).take((self.steps - skip) * batch).batch(batch, drop_remainder=True)

    def load(self) -> Data:
        import tensorflow as tf

        cfg, world, batched, batch = self.cfg, self.world, self.batched, self.batch
        self.shard()
        val = self.val
        if val is not None:
            val = val if batching(val)[0] else val.batch(batch)
            if not self.user_shards and world.size > 1:
                val = shard(val, world.rank, world.size)[0]
        self.mine = self.post(self.pre)
        cardinality = int(self.mine.cardinality())
        if cardinality == tf.data.INFINITE_CARDINALITY or (cardinality < 0 and cfg.steps_per_epoch):
            return self._stream(val, cardinality)
        self.steps, more, total = agree.steps(cfg, world, self.count(), 1 if batched else batch,
                                              "batches" if batched else "samples")
        classes = self._classes(self.mine)
        return Data(self.epoch, val, self.steps, batch, self.epoch(0).element_spec, None if batched else total,
                    self.how, classes, notes=self.notes + more, unrepeatable=unrepeatable(self.train))

    def _stream(self, val, cardinality: int) -> Data:
        """An infinite (repeating) pipeline, or one of unknown size with --steps-per-epoch: one stream
        across epochs, each epoch --steps-per-epoch steps of it."""
        import tensorflow as tf

        cfg, name, batched, batch = self.cfg, self.name, self.batched, self.batch
        if not cfg.steps_per_epoch:
            raise UserError(f"--data {name} is infinite (it repeats): give --steps-per-epoch N, the "
                            f"steps that make one epoch, or make it finite (make_csv_dataset and "
                            f"make_batched_features_dataset repeat unless num_epochs=1)")
        self.notes.append(f"{name} is {'infinite' if cardinality == tf.data.INFINITE_CARDINALITY else 'of unknown size'}"
                          f": each epoch is --steps-per-epoch {cfg.steps_per_epoch} steps of one stream "
                          f"that goes on across epochs")
        stream = self.mine.repeat() if batched else self.mine.repeat().batch(batch, drop_remainder=True)
        classes = self._classes(self.mine.take(cfg.steps_per_epoch * (1 if batched else batch)))
        return Data(None, val, cfg.steps_per_epoch, batch, stream.element_spec, None, self.how, classes,
                    continuous=stream, notes=self.notes)

    def _classes(self, ds) -> Optional[int]:
        """num_classes, counted from the labels when something needs it, else None."""
        return num_classes(ds, self.batched, self.name, self.need_classes) if self.need_classes else None


def from_arrays(pair, name):
    """Validation data given as (x, y) arrays beside a pipeline, as a pipeline."""
    import tensorflow as tf

    if isinstance(pair, (tuple, list)) and len(pair) == 2:
        return tf.data.Dataset.from_tensor_slices(tuple(pair))
    raise UserError(f"--data {name}: validation data must be a tf.data.Dataset or (x, y) arrays, "
                    f"got {type(pair).__name__}")


# ---------------------------------------------------------------- reading a pipeline's stages

def upstream(ds, through: set):
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

    for d in upstream(ds, compat.KEEP_BATCHING):
        name = compat.stage(d)
        if name in compat.BATCHERS:
            return True, compat.batch_of(d)[0]
        if name == compat.UNBATCH:
            return False, None
    shapes = [s.shape for s in tf.nest.flatten(ds.element_spec) if hasattr(s, "shape")]
    if not shapes or any(s.rank == 0 for s in shapes):
        return False, None
    leading = {s[0] if s.rank else None for s in shapes}
    if leading == {None}:
        return True, None
    return False, None




def hold_out(ds, fraction: float, name: str):
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


def in_graph(ds, names=_READERS) -> set:
    """Which datasets of `names` (by default: file readers) a pipeline's graph holds, including
    inside interleave/flat_map functions."""
    import re

    graph = compat.graph_bytes(ds)
    return {name for name in names if re.search(rb"(?<![A-Za-z])" + name.encode() + rb"(V\d)?(?![A-Za-z])", graph)}


def under_the_maps(ds):
    """The pipeline below its one-to-one steps (map, prefetch, shuffle): the same count, no parsing."""
    return list(upstream(ds, compat.ONE_TO_ONE))[-1]


@dataclass(frozen=True)
class Countable:
    """How to count a pipeline's elements without running the user's maps: the records below its
    one-to-one steps and its batching (`records`), the batches they make (`batch`, `drop`), then the
    share of them that element sharding gives this worker (`workers`, `rank`)."""
    records: Any
    batch: Optional[int] = None
    drop: bool = False
    workers: int = 1
    rank: int = 0

    def count(self, name: str) -> int:
        n = count_elements(self.records, name)
        if self.batch:
            n = n // self.batch if self.drop else -(-n // self.batch)
        return len(range(self.rank, n, self.workers))


def records_under(ds) -> Countable:
    """`ds` counted from the records under its maps, shuffles and its last batch of a constant size
    (`list_files -> interleave(TFRecordDataset) -> map(parse) -> shuffle -> batch` counts the raw
    records: the parse never runs before training)."""
    top = under_the_maps(ds)
    if compat.stage(top) in compat.BATCHERS - {"_RebatchDataset", "_DenseToRaggedDataset",
                                                "_DenseToSparseBatchDataset"}:
        size, drop = compat.batch_of(top)
        if size is not None and compat.stage_input(top) is not None:
            return Countable(under_the_maps(compat.stage_input(top)), size, drop)
    return Countable(top)


def shard(ds, rank: int, workers: int):
    """(this worker's shard of ds, a Countable that counts it without the parsing, "file",
    "element" or "batch" (element sharding of a batched pipeline, whose elements are batches), why not
    by file or None, in those same words).

    By file when the pipeline reads files and every worker's share of them holds data: TensorFlow's
    auto-shard rewrite (what tf.distribute does) inserts the shard in front of the reader. tf.data's
    FILE policy would leave a worker with nothing when there are fewer files than workers, so that case
    falls back to element sharding (every worker reads everything and keeps every Nth element). A
    pipeline whose options say AutoShardPolicy.DATA is sharded by element, OFF not at all.
    """
    import tensorflow as tf

    countable = records_under(ds)
    reader = countable.records
    policy = ds.options().experimental_distribute.auto_shard_policy
    if workers == 1 or policy == tf.data.experimental.AutoShardPolicy.OFF:
        return ds, countable, Sharding.NONE, None
    batched = batching(ds)[0]
    unit, units = ("batch", "batches") if batched else ("element", "elements")
    by_element = (ds.shard(workers, rank), dataclasses.replace(countable, workers=workers, rank=rank),
                  Sharding.BATCH if batched else Sharding.ELEMENT)
    if policy == tf.data.experimental.AutoShardPolicy.DATA:
        return (*by_element, None)
    reads = in_graph(ds)
    # asked anyway, TensorFlow's rewrite logs a 100-line error before it gives up
    if not reads & _SHARDABLE_READERS:
        why = (f"its reader ({', '.join(sorted(reads))}) cannot be sharded by file by TensorFlow: sharded "
               f"by {unit} instead, so every worker reads every file") if reads else None
        return (*by_element, why)
    if in_graph(ds, {"RangeDataset"}):  # a source the rewrite cannot walk past
        return (*by_element, f"it numbers its {units} (enumerate, as --val-split does), which TensorFlow "
                             f"cannot shard by file: sharded by {unit} instead, so every worker reads every file")
    try:
        by_file = auto_sharded(ds, workers, rank)
    except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError):
        return (*by_element, None)  # no file reader at the source of the pipeline
    my_reader = auto_sharded(reader, workers, rank)
    try:
        nothing = next(iter(my_reader.take(1)), None) is None
    except tf.errors.InvalidArgumentError:  # "the dataset only has 1 file(s), which is not enough"
        nothing = True
    if agree.any_rank(nothing):
        why = (f"it reads fewer files than the {workers} workers: sharded by {unit} instead, so every "
               f"worker reads every file")
        return (*by_element, why)
    return by_file, dataclasses.replace(countable, records=my_reader), Sharding.FILE, None




def count_elements(ds, name: str) -> int:
    """Elements of a finite pipeline (this worker's shard): its cardinality, or one pass over it."""
    import tensorflow as tf

    n = int(ds.cardinality())
    if n >= 0:
        return n
    try:
        return int(ds.reduce(np.int64(0), lambda c, _: c + 1))
    except tf.errors.OpError as e:
        raise UserError(f"--data {name}: reading it failed ({e.message.splitlines()[0][:300]})") from None


def num_classes(ds, batched: bool, name: str, need: str = "the built-in model") -> int:
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
    classes = agree.largest(top) + 1
    log.info("num_classes for %s: %d, counted in one pass over the data (%.1f s); --num-classes %d "
                     "(hvdtrain.fit: num_classes=%d) skips it", need, classes, time.perf_counter() - t0,
                     classes, classes)
    return classes




def auto_sharded(ds, workers: int, rank: int):
    """ds sharded by file, by TensorFlow's FILE rewrite (what tf.distribute does): the shard goes in
    front of the reader, so a skip inserted above the reader skips records of this worker's files."""
    return compat.shard_files(ds, workers, rank)




def skip_cheaply(ds, n: int):
    """ds.skip(n), with the skip moved below the pipeline's own maps and batches (rebuilt above it
    from their traced functions): what is skipped is read, but not parsed or decoded."""
    import tensorflow as tf

    if not n:
        return ds
    stages, below, count = [], ds, n
    while compat.stage(below) in compat.REBUILT:
        stages.append(below)
        if compat.stage(below) == "_BatchDataset":  # every batch before the resume point is full
            count *= compat.batch_of(below)[0]
        below = compat.stage_input(below)
    try:
        out = below.skip(count)
        for stage in reversed(stages):
            out = again(stage, out)
        if out.element_spec != ds.element_spec:
            raise ValueError(f"{out.element_spec} != {ds.element_spec}")
        return out
    except (ValueError, TypeError, tf.errors.OpError) as e:  # a stage tf.data does not let us rebuild
        runtime.fallback("skip", f"resuming inside an epoch: skipping {n} elements of the pipeline by reading "
                                 f"and parsing them, since its stages could not be rebuilt below the skip", e)
        return ds.skip(n)


def again(stage, ds):
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




def peek_batch_size(ds) -> int:
    """A batched pipeline whose batch size tf.data does not say: look at its first batch."""
    import tensorflow as tf

    first = next(iter(ds.take(1)), None)
    if first is None:
        return DEFAULT_BATCH_SIZE
    return int(tf.nest.flatten(first)[0].shape[0])
