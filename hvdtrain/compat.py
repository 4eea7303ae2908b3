"""The one door to what differs between the two Keras generations, and to the private names of
TensorFlow, Keras and Horovod that hvdtrain relies on.

hvdtrain runs on two stacks (scripts/setup.sh): Keras 2 (`tf.keras` of TensorFlow 2.15) and Keras 3
(`keras`, which is `tf.keras` from TensorFlow 2.16 on). Most of Keras' public API is the same on both;
what is not, and every private name, is answered here, so that a new TensorFlow or Keras breaks one
module, and tests/test_compat.py says which name broke.
"""
from __future__ import annotations

import contextlib
import functools


@functools.lru_cache(maxsize=None)
def keras_major() -> int:
    """2 or 3: the Keras generation `tf.keras` is (Keras 3 has `keras.ops`; Keras 2 has not)."""
    import tensorflow as tf

    return 3 if hasattr(tf.keras, "ops") else 2


def keras3() -> bool:
    return keras_major() == 3


def keras_version() -> str:
    """The version of the `keras` package: 3.x on the keras3 stack, 2.15.0 beside TensorFlow 2.15."""
    import keras

    return keras.__version__


def stack() -> dict:
    """Which of hvdtrain's two stacks this process runs, and its versions."""
    import platform

    import numpy
    import tensorflow as tf

    return {"stack": f"keras{keras_major()}", "python": platform.python_version(), "tensorflow": tf.__version__,
            "keras": keras_version(), "numpy": numpy.__version__}


def compile_config(model) -> dict:
    """What the user passed to model.compile (optimizer, loss, metrics, ...), or {} if uncompiled."""
    compiled = getattr(model, "compiled", None) if keras3() else getattr(model, "_is_compiled", False)
    config = getattr(model, "_compile_config", None)
    return dict(config.config) if compiled and config is not None else {}


def compiled_steps_per_execution(config: dict):
    """The steps per call a compile config asked for, or None: Keras 3's compile writes its default, 1,
    which cannot be told from asking for 1 (Keras 2 writes None)."""
    asked = config.get("steps_per_execution")
    return None if keras3() and asked == 1 else asked


def producer(tensor):
    """The layer that made a functional model's output tensor (None where it cannot be read)."""
    history = getattr(tensor, "_keras_history", None)
    return getattr(history, "operation", None) or getattr(history, "layer", None)


def sublayers(model) -> list:
    """Every layer inside `model`, nested models' layers too (Keras 3 models are no tf.Module)."""
    if keras3():
        return list(model._flatten_layers(include_self=False, recursive=True))
    return list(model.submodules)


def random_layers(model) -> list:
    """The names of layers that draw random numbers in training (Dropout, ...): their generator's
    state is kept in kernels, not in a checkpoint."""
    attr = "seed_generator" if keras3() else "_random_generator"
    return sorted({layer.name for layer in sublayers(model) if getattr(layer, attr, None) is not None})


def tf_variables(variables) -> list:
    """The tf.Variables behind Keras variables: Keras 3 wraps each in a keras.Variable, which
    Horovod's broadcast and TensorFlow's ops do not take as a variable. Lookup tables' handles, which
    Keras 2 lists among a model's variables, are left out."""
    import tensorflow as tf

    out = []
    for v in variables:
        v = v if isinstance(v, tf.Variable) or not keras3() else getattr(v, "value", v)
        if isinstance(v, tf.Variable):
            out.append(v)
    return out


def variable_path(variable) -> str:
    """A variable's name inside its model: Keras 3's path ("dense/kernel"), Keras 2's name ("dense/kernel:0")."""
    return getattr(variable, "path", None) or variable.name


def sequence_epoch_ends_before_training() -> int:
    """How often Keras' fit calls a Sequence's on_epoch_end before the first epoch: Keras 3's epoch
    iterator resets the PyDataset once first (trainers/epoch_iterator.py, reset()); Keras 2 never."""
    return 1 if keras3() else 0


def lr_schedule(optimizer):
    """The LearningRateSchedule an optimizer (or a LossScaleOptimizer's inner one) was made with, or
    None: Keras 3's `learning_rate` gives the schedule's current value, not the schedule."""
    import tensorflow as tf

    lr = getattr(getattr(optimizer, "inner_optimizer", optimizer), "_learning_rate", None)
    return lr if isinstance(lr, tf.keras.optimizers.schedules.LearningRateSchedule) else None


@contextlib.contextmanager
def before_apply_gradients(hook):
    """Within: hook(optimizer) runs before any Keras optimizer's apply_gradients. Keras has no such
    hook, so the method is wrapped where Keras' optimizer base classes define it (Keras 2 has two:
    the optimizer and the legacy one), and put back on leaving."""
    import tensorflow as tf

    bases = [tf.keras.optimizers.Optimizer] if keras3() else \
        [tf.keras.optimizers.Optimizer, tf.keras.optimizers.legacy.Optimizer]
    owners = {next(c for c in base.__mro__ if "apply_gradients" in vars(c)) for base in bases}
    kept = {owner: vars(owner)["apply_gradients"] for owner in owners}

    def hooked(original):
        @functools.wraps(original)
        def apply_gradients(self, *args, **kwargs):
            hook(self)
            return original(self, *args, **kwargs)
        return apply_gradients

    try:
        for owner, original in kept.items():
            owner.apply_gradients = hooked(original)
        yield
    finally:
        for owner, original in kept.items():
            owner.apply_gradients = original


def past_autograph(error: Exception) -> Exception:
    """`error` marked to leave a traced step as it is: AutoGraph (Keras 2 converts the step) would
    rewrite its message into a stack of the converted code."""
    error.ag_pass_through = True  # type: ignore[attr-defined]
    return error


def built_for(optimizer) -> list:
    """Keras 3: the variables an optimizer was built for, in the order `apply(grads)` takes them."""
    return optimizer._trainable_variables


def checkpointed(model):
    """What tf.train.Checkpoint saves of the model. A Keras 2 model is a trackable object graph; a
    Keras 3 model is not tracked by TensorFlow at all (a checkpoint of model=model holds only what its
    optimizer tracks: no BatchNorm statistics), so there its variables go in by their paths within the
    model ("hidden/kernel": the names a checkpoint that no longer fits reports)."""
    if not keras3():
        return model
    prefix = model.name + "/"
    return {v.path[len(prefix):] if v.path.startswith(prefix) else v.path: v.value for v in model.variables}


def checkpoint_key_name(key: str, layers: list) -> str:
    """A readable name for a checkpoint key of the model's ("model/layer_with_weights-1/kernel/..." on
    Keras 2, "model/hidden.Skernel/..." on Keras 3): "hidden/kernel"."""
    parts = key[len("model/"):].replace("/.ATTRIBUTES/VARIABLE_VALUE", "").split("/")
    i = parts[0].rsplit("-", 1)[-1]
    if parts[0].startswith("layer_with_weights-") and i.isdigit() and int(i) < len(layers):
        parts[0] = layers[int(i)]
    return "/".join(parts).replace(".S", "/")


def steps_per_execution(model) -> int:
    """The number of steps a call of the compiled step runs (a variable on Keras 2, an int on 3)."""
    n = model.steps_per_execution
    return int(n.numpy()) if hasattr(n, "numpy") else int(n)


def acts_per_batch(callback) -> bool:
    """Does Keras call this callback for something at every training batch? Keras 2 asks the callback
    itself (_implements_train_batch_hooks: a ModelCheckpoint saving per epoch says no). Keras 3 has no
    such question and calls every callback's hooks: its batch hooks overridden, said the same way for
    the Keras callbacks that do nothing per batch as configured (ModelCheckpoint with
    save_freq="epoch", TensorBoard writing per epoch without a profile)."""
    import tensorflow as tf

    if not keras3():
        return bool(callback._implements_train_batch_hooks())
    base = tf.keras.callbacks.Callback
    hooks = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")
    if not any(getattr(type(callback), h) is not getattr(base, h) for h in hooks):
        return False
    if isinstance(callback, tf.keras.callbacks.ModelCheckpoint):
        return callback.save_freq != "epoch"
    if isinstance(callback, tf.keras.callbacks.TensorBoard):
        return bool(callback._should_trace or callback.write_steps_per_second or callback.update_freq != "epoch")
    return True


def serialize_as(cls, base):
    """Keras saves an instance of `cls` (the distributed optimizer: hvdtrain's subclass of the user's
    optimizer class on Keras 3, Horovod's on Keras 2) as one of `base`: a user's
    ModelCheckpoint("best.keras") then loads in plain Keras, neither hvdtrain nor Horovod imported.
    Keras names its own classes by their public name, found by class (Keras 3: a registry; Keras 2:
    the class's own _keras_api_names), and a user's class by its registered name (a registry by
    class); `cls` is given `base`'s, from class to name only, so that loading makes a `base`."""
    if keras3():
        from keras.src import api_export
        from keras.src.saving import object_registration

        public = api_export.get_name_from_symbol(base)
        if public is not None:
            api_export.REGISTERED_OBJS_TO_NAMES[cls] = public
            return
    else:
        from keras.src.saving import object_registration

        names = {a: base.__dict__[a] for a in ("_keras_api_names", "_keras_api_names_v1") if a in base.__dict__}
        if names:
            for attr, value in names.items():
                setattr(cls, attr, value)
            return
    by_class = object_registration.GLOBAL_CUSTOM_NAMES if keras3() else object_registration._GLOBAL_CUSTOM_NAMES
    by_class[cls] = object_registration.get_registered_name(base)


def calls_can_be_cut_short() -> bool:
    """Keras 2 reads steps_per_execution before every call of the step, so a call can be cut short
    to end on a given step; Keras 3 fixes it for the whole fit() (its epoch iterator and traced loop)."""
    return not keras3()


def uncompiled_copy(model):
    """A new model of the same architecture, uncompiled. Keras 3's clone_model compiles the copy from
    the original's compile config, which names the distributed optimizer's class; its Sequential and
    functional models are rebuilt from their config instead. A subclassed model raises, as on Keras 2."""
    import tensorflow as tf

    if not keras3():
        return tf.keras.models.clone_model(model)
    if type(model) is tf.keras.Sequential or type(model).__name__ == "Functional":
        return type(model).from_config(model.get_config())
    raise NotImplementedError(f"{type(model).__name__} is a subclassed model")


def own_loss_and_metrics_are_built(model) -> bool | None:
    """Keras 2: has the compiled loss been built (None: no compiled loss)? Keras 3 builds its loss
    and metrics outside the traced step already: None."""
    if keras3():
        return None
    loss = getattr(model, "compiled_loss", None)
    return None if loss is None else loss.built


def allreduce_gradients_fn(op, compression, sparse_as_dense: bool, groups):
    """Horovod's own gradient allreduce, the one its DistributedOptimizer and DistributedGradientTape
    use (sparse gradients, fp16 compression, groups, Adasum): a function (grads, vars) -> grads."""
    from horovod.tensorflow import _make_allreduce_grads_fn

    return _make_allreduce_grads_fn("DistributedOptimizer", "", "", compression, sparse_as_dense, op,
                                    1.0, groups or None, _global_process_set())


def _global_process_set():
    import horovod.tensorflow as hvd

    return hvd.global_process_set


def take_logs_as_tensors(callback):
    """Tell Keras 2 that this callback takes a step's logs as tensors (no host sync per step for it);
    Keras 3 converts them for every callback anyway."""
    callback._supports_tf_logs = True


# Horovod's Keras 2 DistributedOptimizer (the keras2 stack): the function it allreduces gradients with

def horovod_allreduce_grads(opt):
    return opt._allreduce_grads


def set_horovod_allreduce_grads(opt, fn):
    """Replace it, also in the helper that --backward-passes-per-step's accumulation keeps."""
    opt._allreduce_grads = fn
    if opt._agg_helper is not None:
        opt._agg_helper.allreduce_grads = fn


def horovod_allreduce(opt, grads, variables) -> list:
    """The gradients averaged as the DistributedOptimizer averages them."""
    return opt._allreduce(grads, variables)


def elastic_state(model, **kwargs):
    """hvd.elastic's state of the model and its optimizer, with `kwargs` as attributes: Horovod's
    KerasState on Keras 2. Horovod's reads `optimizer.variables()` and broadcasts Keras' variables
    as they are, which Keras 3 has not; there the same state (save, restore, sync from rank 0) holds
    the tf.Variables behind them."""
    import horovod.tensorflow as hvd

    if not keras3():
        import horovod.tensorflow.keras as hvd_keras

        return hvd_keras.elastic.KerasState(model, **kwargs)
    from horovod.common.elastic import ObjectState

    class KerasThreeState(ObjectState):
        def __init__(self):
            self._save_model()
            super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **kwargs)

        def _variables(self):
            return tf_variables(model.variables) + tf_variables(model.optimizer.variables)

        def _save_model(self):
            self._saved = [v.numpy() for v in self._variables()]

        def save(self):
            self._save_model()
            super().save()

        def restore(self):
            for v, saved in zip(self._variables(), self._saved):
                v.assign(saved)
            super().restore()

        def sync(self):
            hvd.broadcast_variables(self._variables(), root_rank=0)
            self._save_model()
            super().sync()

    return KerasThreeState()


def update_checkpoint_state(directory: str, path: str, kept: list):
    """Point the `checkpoint` index at `path`, atomically (what tf.train.CheckpointManager does)."""
    from tensorflow.python.checkpoint.checkpoint_management import update_checkpoint_state_internal

    update_checkpoint_state_internal(directory, path, all_model_checkpoint_paths=kept,
                                     save_relative_paths=True)


# ---------------------------------------------------------------- tf.data's pipeline, stage by stage
# A tf.data.Dataset object knows the stage it is (its class: _MapDataset, _BatchDataset, ...) and the
# dataset it reads; TensorFlow has no public API for either. data/pipeline.py reads pipelines through these.

# tf.data's Python classes, by what they do to the elements that pass through (TensorFlow 2.15-2.21)
ONE_TO_ONE = {"_MapDataset", "_ParallelMapDataset", "_PrefetchDataset", "_ShuffleDataset",
              "_OptionsDataset", "CacheDataset", "_AssertCardinalityDataset"}
KEEP_BATCHING = ONE_TO_ONE | {"_FilterDataset", "_TakeDataset", "_SkipDataset", "_RepeatDataset",
                              "_ShardDataset", "_IgnoreErrorsDataset", "_TakeWhileDataset"}
BATCHERS = {"_BatchDataset", "_ParallelBatchDataset", "_PaddedBatchDataset", "_RebatchDataset",
            "_DenseToRaggedDataset", "_DenseToSparseBatchDataset"}
UNBATCH = "_UnbatchDataset"
REBUILT = {"_MapDataset", "_ParallelMapDataset", "_PrefetchDataset", "_BatchDataset"}  # skip_cheaply redoes

def stage(ds) -> str:
    """The kind of stage `ds` is: its class's name (_MapDataset, _BatchDataset, TFRecordDatasetV2...)."""
    return type(ds).__name__


def stage_input(ds):
    """The dataset a one-input stage (map, batch, shuffle, ...) reads; None for a source or a stage
    of several inputs."""
    return getattr(ds, "_input_dataset", None)


def stage_inputs(ds) -> list:
    """Every dataset a stage reads (several for zip, concatenate, interleave's input...)."""
    return list(ds._inputs())


def batch_of(ds) -> tuple:
    """(batch size, drop_remainder) of a batching stage; the size is None when it is a tensor that
    is not a constant."""
    import tensorflow as tf

    size = tf.get_static_value(ds._batch_size)
    return (None if size is None else int(size)), bool(tf.get_static_value(getattr(ds, "_drop_remainder", False)))


def reshuffles(ds) -> bool:
    """Does a shuffle stage draw a new order every epoch (reshuffle_each_iteration)?"""
    return bool(getattr(ds, "_reshuffle_each_iteration", True))


def nondeterministic(ds) -> bool:
    """Was this stage asked to run with deterministic=False (parallel map, interleave)?"""
    return getattr(ds, "_deterministic", None) == "false"


def graph_bytes(ds) -> bytes:
    """The pipeline's serialized graph, functions included (what interleave and flat_map read)."""
    return ds._as_serialized_graph().numpy()


def shard_files(ds, workers: int, rank: int):
    """ds sharded by file with TensorFlow's FILE auto-shard rewrite (what tf.distribute does): the
    shard goes in front of the reader."""
    import tensorflow as tf
    from tensorflow.python.data.experimental.ops.distribute import _AutoShardDataset

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.FILE
    return _AutoShardDataset(ds.with_options(options), workers, rank)


def map_again(stage_ds, ds, num_parallel_calls=None):
    """The function of a map stage, applied again to another input of the same element structure."""
    from tensorflow.python.data.util import structure

    wrapper = stage_ds._map_func

    def apply(*args):
        flat = structure.to_tensor_list(wrapper._input_structure, args if len(args) > 1 else args[0])
        return structure.from_compatible_tensor_list(wrapper.output_structure, wrapper.function(*flat))
    return ds.map(apply, num_parallel_calls=num_parallel_calls,
                  deterministic=True if num_parallel_calls else None)
