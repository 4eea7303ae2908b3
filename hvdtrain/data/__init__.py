"""Data sources, and the shard of them that this worker reads: one adapter per kind of input, in the
spirit of Keras' data adapters.

    arrays.py    (x, y) arrays, an npz file, the built-in sets        sharded by element (indices)
    records.py   hvdtrain's own TFRecord files (tfrecord:GLOB)       by file, or by element
    pipeline.py  a tf.data pipeline of yours (module:function, ...)  by file, element or batch, or yours
    sequence.py  a keras.utils.Sequence (Keras 3: PyDataset)         by batch index

Each adapter says whether it can handle an input (`can_handle`), how it shards (`shard`), how it
counts this worker's shard (`count`) and how an epoch skips to a step on resume (`epoch(e, skip)`);
`load` makes the Data the trainer reads. Their collectives are in agree.py, called in the same order
on every rank; core.py holds Data and the seeded order.

One rule holds for all: each worker reads only its own shard, and every worker runs the same number of
steps per epoch, so an uneven split never leaves a rank waiting in an allreduce (and the samples it
leaves out are logged). Shuffling is seeded by (seed, epoch), identical on every rank, and done before
element sharding: the union of the workers' batches at step k is the global batch one worker would see
at batch_size x workers, and a resumed run sees the order of an uninterrupted one. A run resumed
inside an epoch (a step checkpoint) starts that epoch at the next step without reading what came
before and dropping it; records are shuffled in fixed windows, so a window can be rebuilt alone.

Your pipeline, `--data module:function` or `hvdtrain.fit(model, data)`: `def dataset(ctx)` gets this
worker's DataContext (rank, workers, batch sizes, seed, `shard`) and returns a pipeline it sharded;
`def dataset()` (or a Dataset object) is sharded here; either may return `(train, val)`.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Optional

from ..config import DEFAULT_BATCH_SIZE, Config, UserError
from ..runtime import World
from .arrays import Arrays
from .core import Data, last_fraction, split
from .pipeline import Pipeline, batching, from_arrays, shard, skip_cheaply, unrepeatable
from .records import Records, write_tfrecords
from .sequence import Sequences

__all__ = ["Data", "DataContext", "last_fraction", "load", "resolve", "write_tfrecords", "shard", "batching", "skip_cheaply",
           "unrepeatable"]


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
    """This worker's Data from `source` (a --data string, a function, a Dataset, a Sequence or arrays;
    default cfg.data), through the adapter that can handle it. need_classes: what needs the number of
    classes from the labels (a built-in model, a model function that takes num_classes), or None."""
    return adapter(cfg, world, source, validation, need_classes).load()


def adapter(cfg: Config, world: World, source=None, validation=None, need_classes: Optional[str] = None):
    source = cfg.data if source is None else source
    if Records.can_handle(source):
        return Records(cfg, world, source)
    if isinstance(source, str):  # a built-in set or an .npz file, else "module:function"
        if Arrays.can_handle(source):
            return Arrays.named(cfg, world, source, need_classes)
        source = resolve(source, "--data")
    name, user_shards = cfg.data, False
    if callable(source) and not Pipeline.can_handle(source):
        source, user_shards = _call_data_function(source, cfg, world)
    if validation is None and isinstance(source, (tuple, list)) and len(source) == 2 \
            and all(Pipeline.can_handle(d) or Sequences.can_handle(d) for d in source):
        source, validation = source
    if Sequences.can_handle(source):
        return Sequences(cfg, world, source, validation, need_classes)
    if Pipeline.can_handle(source):
        if validation is not None and not Pipeline.can_handle(validation):
            validation = from_arrays(validation, name)
        return Pipeline(cfg, world, name, source, validation, user_shards, need_classes)
    if Arrays.can_handle(source):
        x, y = source
        xv, yv = validation if validation is not None else (None, None)
        if validation is None and cfg.val_split:
            x, y, xv, yv = split(x, y, cfg.val_split)
        return Arrays(cfg, world, x, y, xv, yv)
    raise UserError(f"--data {name}: expected a tf.data.Dataset or a keras.utils.Sequence (or a (train, val) "
                    f"pair of them), or (x, y) arrays, got {type(source).__name__}")


def resolve(ref: str, what: str):
    """Import module:function, with one clear error when it does not."""
    mod_name, _, fn_name = ref.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:  # noqa: BLE001 (whatever the user's module raises, said in one line)
        raise UserError(f"{what} {ref}: cannot import module '{mod_name}' ({type(e).__name__}: {e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UserError(f"{what} {ref}: module '{mod_name}' has no function '{fn_name}'")
    return fn


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
