"""Every private TensorFlow, Keras and Horovod name hvdtrain uses (all in hvdtrain/compat.py), each
checked on the installed stack: a TensorFlow or Keras that renames one fails here, by name, not as a
silent fallback somewhere in training."""
import numpy as np
import pytest
import tensorflow as tf

from hvdtrain import compat, data

pytestmark = pytest.mark.stacks  # the private names, checked on both stacks


def _all_dataset_classes():
    seen, todo = set(), [tf.data.Dataset]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub.__name__ not in seen:
                seen.add(sub.__name__)
                todo.append(sub)
    return seen


def _stages():
    """Each stage hvdtrain names (compat.py), made as a pipeline makes it."""
    ds = tf.data.Dataset.range(8)
    options = tf.data.Options()
    options.threading.max_intra_op_parallelism = 1
    options.threading.private_threadpool_size = 2
    options.autotune.enabled = True
    return {
        "_MapDataset": ds.map(lambda i: i), "_ParallelMapDataset": ds.map(lambda i: i, num_parallel_calls=2),
        "_PrefetchDataset": ds.prefetch(1), "_ShuffleDataset": ds.shuffle(4),
        "_OptionsDataset": ds.with_options(options),
        "CacheDataset": ds.cache(), "_AssertCardinalityDataset": ds.apply(tf.data.experimental.assert_cardinality(8)),
        "_FilterDataset": ds.filter(lambda i: i > 0), "_TakeDataset": ds.take(2), "_SkipDataset": ds.skip(2),
        "_RepeatDataset": ds.repeat(2), "_ShardDataset": ds.shard(2, 0), "_IgnoreErrorsDataset": ds.ignore_errors(),
        "_TakeWhileDataset": ds.take_while(lambda i: i < 4), "_BatchDataset": ds.batch(2),
        "_ParallelBatchDataset": ds.batch(2, num_parallel_calls=2), "_PaddedBatchDataset": ds.padded_batch(2),
        "_RebatchDataset": ds.batch(4).rebatch(2), "_UnbatchDataset": ds.batch(2).unbatch(),
        "_DenseToRaggedDataset": ds.map(lambda i: tf.range(i)).apply(tf.data.experimental.dense_to_ragged_batch(2)),
        "_DenseToSparseBatchDataset": ds.map(lambda i: tf.range(i)).apply(
            tf.data.experimental.dense_to_sparse_batch(2, [8])),
    }


def test_every_stage_a_pipeline_makes_is_one_hvdtrain_knows():
    """A batching stage is known as one (however this TensorFlow implements ragged batching), a
    one-to-one stage as one, and so on: a renamed class fails here, not as a wrong shard or count."""
    kinds = {"batch": compat.BATCHERS, "keep": compat.KEEP_BATCHING, "one": compat.ONE_TO_ONE}
    unknown = {name: compat.stage(d) for name, d in _stages().items()
               if compat.stage(d) not in kinds[_KIND.get(name, "keep")] | {name}
               or (name in compat.BATCHERS) != (compat.stage(d) in compat.BATCHERS)}
    assert unknown == {}, f"tf.data {tf.__version__}: stages hvdtrain does not know as such"
    gone = (compat.ONE_TO_ONE | compat.KEEP_BATCHING | compat.BATCHERS) - _all_dataset_classes()
    allowed = {"_DenseToRaggedDataset"}  # TensorFlow 2.18 batches ragged with _BatchDataset
    assert gone <= allowed, f"tf.data {tf.__version__} has no stage named {sorted(gone - allowed)}"


_KIND = {"_BatchDataset": "batch", "_ParallelBatchDataset": "batch", "_PaddedBatchDataset": "batch",
         "_RebatchDataset": "batch", "_DenseToRaggedDataset": "batch", "_DenseToSparseBatchDataset": "batch"}


def test_a_stage_names_its_kind_and_its_input():
    source = tf.data.Dataset.range(10)
    mapped = source.map(lambda i: i * 2)
    assert compat.stage(mapped) == "_MapDataset"
    assert compat.stage_input(mapped) is source
    assert compat.stage_input(source) is None
    zipped = tf.data.Dataset.zip((source, mapped))
    assert compat.stage_inputs(zipped) == [source, mapped]


def test_a_batch_stage_gives_its_size_and_remainder_rule():
    ds = tf.data.Dataset.range(10)
    assert compat.batch_of(ds.batch(4)) == (4, False)
    assert compat.batch_of(ds.batch(3, drop_remainder=True)) == (3, True)


def test_shuffle_and_determinism_flags_are_read():
    ds = tf.data.Dataset.range(10)
    assert compat.reshuffles(ds.shuffle(10)) and not compat.reshuffles(ds.shuffle(10, reshuffle_each_iteration=False))
    assert compat.nondeterministic(ds.map(lambda i: i, num_parallel_calls=2, deterministic=False))
    assert not compat.nondeterministic(ds.map(lambda i: i, num_parallel_calls=2))


def test_the_serialized_graph_names_the_readers_inside_an_interleave(tmp_path):
    files = data.write_tfrecords(np.zeros((4, 2), np.float32), np.zeros(4, np.int64), str(tmp_path / "r"), 2)
    ds = tf.data.Dataset.from_tensor_slices(files).interleave(tf.data.TFRecordDataset)
    assert b"TFRecordDataset" in compat.graph_bytes(ds)


def test_file_sharding_gives_each_worker_its_own_files(tmp_path):
    x = np.arange(8, dtype=np.float32).reshape(8, 1)
    files = data.write_tfrecords(x, np.zeros(8, np.int64), str(tmp_path / "r"), 2)
    ds = tf.data.Dataset.from_tensor_slices(sorted(files)).interleave(tf.data.TFRecordDataset)
    shards = [list(compat.shard_files(ds, 2, r).as_numpy_iterator()) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == 4 and not set(shards[0]) & set(shards[1])


def test_a_map_stage_is_applied_again_to_another_input():
    stage = tf.data.Dataset.range(3).map(lambda i: (i, i * 10))
    again = compat.map_again(stage, tf.data.Dataset.range(5, 7))
    assert [tuple(map(int, e)) for e in again] == [(5, 50), (6, 60)]


def test_the_checkpoint_index_is_written_by_tensorflows_own_function(tmp_path):
    v = tf.Variable(1.0)
    path = tf.train.Checkpoint(v=v).write(str(tmp_path / "ckpt-1"))
    compat.update_checkpoint_state(str(tmp_path), path, [path])
    assert tf.train.latest_checkpoint(str(tmp_path)) == path


def test_horovods_gradient_allreduce_function_is_there_and_averages():
    import horovod.tensorflow as hvd

    hvd.init()
    fn = compat.allreduce_gradients_fn(hvd.Average, hvd.Compression.none, False, None)
    grads = fn([tf.constant([1.0, 3.0]), None], [tf.Variable([0.0, 0.0]), tf.Variable(0.0)])
    assert grads[1] is None and grads[0].numpy().tolist() == [1.0, 3.0]  # one worker: its own


def _compiled_model():
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(4, activation="softmax", name="out"),
                                 tf.keras.layers.Dropout(0.5)])
    model.compile(tf.keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
    return model


def test_keras_internals_read_the_compile_the_layers_and_the_variables():
    model = _compiled_model()
    assert compat.compile_config(model)["loss"] == "mse"
    assert compat.compile_config(tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])) == {}
    assert {l.name for l in compat.sublayers(model)} >= {"out"}
    assert compat.random_layers(model) == [model.layers[-1].name]
    first_dense = model.layers[0]
    functional = tf.keras.Model(model.inputs, first_dense.output)
    assert compat.producer(functional.outputs[0]) is first_dense
    variables = compat.tf_variables(model.variables)  # Keras 3 lists Dropout's seed among them
    assert all(isinstance(v, tf.Variable) for v in variables)
    assert [v.shape for v in variables if v.dtype.is_floating] == [(3, 4), (4,)]
    model.optimizer.build(model.trainable_variables)
    if compat.keras3():
        assert compat.built_for(model.optimizer) == model.trainable_variables
    assert compat.steps_per_execution(model) == 1


def test_an_uncompiled_copy_has_the_architecture_and_no_compile():
    model = _compiled_model()
    copy = compat.uncompiled_copy(model)
    assert [l.name for l in copy.layers] == [l.name for l in model.layers] and not compat.compile_config(copy)


@pytest.mark.skipif(compat.keras3(), reason="Horovod's Keras 2 DistributedOptimizer: the keras2 stack")
def test_horovods_keras2_optimizer_internals_are_there():
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras

    hvd.init()
    for passes in (1, 2):
        opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), backward_passes_per_step=passes)
        fn = compat.horovod_allreduce_grads(opt)
        assert callable(fn.python_function)
        compat.set_horovod_allreduce_grads(opt, fn)
        v = tf.Variable([1.0, 2.0])
        assert compat.horovod_allreduce(opt, [tf.constant([3.0, 4.0])], [v])[0].numpy().tolist() == [3.0, 4.0]
    callback = tf.keras.callbacks.Callback()
    compat.take_logs_as_tensors(callback)
    assert callback._supports_tf_logs


def test_sequence_epoch_ends_before_training_is_what_keras_fit_calls():
    """Keras 3's fit resets a PyDataset (one on_epoch_end) before its first epoch; Keras 2's does not.
    Each batch read records the on_epoch_end calls made by then (Keras may peek at a batch first)."""
    import numpy as np
    import tensorflow as tf

    class Seq(tf.keras.utils.Sequence):
        def __init__(self):
            super().__init__()
            self.ended, self.reads = 0, []

        def __len__(self):
            return 2

        def __getitem__(self, i):
            self.reads.append(self.ended)
            return np.zeros((2, 1), "float32"), np.zeros((2, 1), "float32")

        def on_epoch_end(self):
            self.ended += 1

    model = tf.keras.Sequential([tf.keras.Input((1,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    seq = Seq()
    model.fit(seq, epochs=2, verbose=0, shuffle=False)
    before = compat.sequence_epoch_ends_before_training()
    assert seq.reads[-4:] == [before, before, before + 1, before + 1] and seq.ended == 2 + before


def test_a_resume_inside_an_epoch_parses_no_skipped_record(monkeypatch):
    """skip_cheaply moves the skip below the pipeline's map and batch: the 20 records of the 5 skipped
    batches are read, but the map (the parsing) runs only for the 80 that train."""
    monkeypatch.setenv("HVDTRAIN_NO_FALLBACK", "1")
    calls = tf.Variable(0, dtype=tf.int64)

    def parse(i):
        calls.assign_add(1)
        return i * 2

    rest = data.skip_cheaply(tf.data.Dataset.range(100).map(parse).batch(4).prefetch(2), 5)
    batches = [b.numpy().tolist() for b in rest]
    assert batches[0] == [40, 42, 44, 46] and len(batches) == 20
    assert int(calls.numpy()) == 80


def test_keras_callbacks_that_do_nothing_per_batch_as_configured_do_not_act_per_batch():
    """What decides 1 step per call: a ModelCheckpoint saving per epoch, a TensorBoard writing per
    epoch without a profile and the callbacks without batch hooks do not act per batch; a per-step
    save or one's own batch hook does."""
    cbs = tf.keras.callbacks

    class Own(cbs.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    assert not compat.acts_per_batch(cbs.ModelCheckpoint("best.keras", save_best_only=True))
    assert compat.acts_per_batch(cbs.ModelCheckpoint("m.keras", save_freq=5))
    assert not compat.acts_per_batch(cbs.TensorBoard("tb", profile_batch=0))
    assert not compat.acts_per_batch(cbs.EarlyStopping()) and not compat.acts_per_batch(cbs.CSVLogger("l.csv"))
    assert compat.acts_per_batch(Own())


def test_the_distributed_optimizer_is_saved_as_the_users_class():
    """A subclass of the user's optimizer class made to serialize as it: Keras writes the user's class
    name, so a model saved mid-training (ModelCheckpoint) loads without hvdtrain."""
    for base in (tf.keras.optimizers.Adam, _UsersOwnSGD):
        cls = type(f"Distributed{base.__name__}", (base,), {"__module__": "hvdtrain.optimizer"})
        compat.serialize_as(cls, base)
        config = tf.keras.optimizers.serialize(cls(learning_rate=0.5))
        assert tf.keras.optimizers.deserialize(config, custom_objects={"_UsersOwnSGD": _UsersOwnSGD}).__class__ is base


class _UsersOwnSGD(tf.keras.optimizers.SGD):
    pass


def test_the_hook_before_apply_gradients_sees_every_optimizer_and_is_gone_after():
    var = tf.Variable([1.0])
    opts = [tf.keras.optimizers.SGD(0.5), tf.keras.optimizers.Adam(0.5)]
    if not compat.keras3():
        opts.append(tf.keras.optimizers.legacy.SGD(0.5))
    seen = []
    with compat.before_apply_gradients(seen.append):
        for opt in opts:
            opt.apply_gradients([(tf.constant([1.0]), var)])
    assert [id(o) for o in seen] == [id(o) for o in opts]
    opts[0].apply_gradients([(tf.constant([1.0]), var)])
    assert len(seen) == len(opts) and var.numpy()[0] < 0  # put back, and the updates were made


def _refuse(x, mark):
    error = ValueError("one line")
    raise compat.past_autograph(error) if mark else error


def _step(x, mark):
    return _refuse(x * 2, mark)  # a converted call, as Keras 2's step reaches its train_step


@pytest.mark.parametrize("mark", [True, False])
def test_an_error_marked_past_autograph_leaves_a_traced_step_as_it_was_raised(mark):
    with pytest.raises(ValueError) as raised:
        tf.function(_step)(tf.constant(1.0), mark)
    assert (str(raised.value) == "one line") == mark  # unmarked: AutoGraph's "in user code: ..."
