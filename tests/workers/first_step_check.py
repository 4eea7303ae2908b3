"""What the first step costs: how often Keras traces it, and whether AutoGraph converts Horovod's allreduce.

For users' compiled models (sparse, one-hot and binary labels, two heads, padded token sequences),
trained by hvdtrain.fit and by plain Keras fit: the metrics Keras picked and the number of traces of
the training step.
For the gradients' allreduce, Horovod's own DistributedOptimizer against hvdtrain's: the functions
AutoGraph converted while tracing it (its log, verbosity 1) and the ops it built.
"""
import collections
import contextlib
import io
import json
import tempfile

import numpy as np
import horovod.tensorflow.keras as hvd
import tensorflow as tf

import hvdtrain
import user_models
from hvdtrain import config, optimizer, runtime

world = hvdtrain.init()
rng = np.random.default_rng(0)
n = 128
image = rng.standard_normal((n, 8, 8, 1)).astype("float32")
digit = np.arange(n) % 10
CASES = {
    "sparse": (lambda: user_models.small_bn_cnn((8, 8, 1), 10), image, digit),
    "one_hot": (lambda: user_models.mnist_convnet((8, 8, 1), 10), image, np.eye(10, dtype="float32")[digit]),
    "binary": (user_models.binary, rng.standard_normal((n, 30)).astype("float32"),
               (digit % 2).astype("float32")),
    "two_heads": (user_models.two_heads, image, {"digit": digit, "odd": (digit % 2).astype("float32")}),
    "padded_tokens": (user_models.bag_of_tokens, None, None),  # batches of any length: tokens_dataset()
}


def tokens_dataset():
    """Token sequences of 3 to 11 ids, padded per batch (tf.data's padded_batch): shape (None, None)."""
    seqs = [rng.integers(1, 100, rng.integers(3, 12)) for _ in range(n)]
    return tf.data.Dataset.from_generator(
        lambda: ((s, np.float32(s.sum() % 2)) for s in seqs),
        output_signature=(tf.TensorSpec([None], tf.int64), tf.TensorSpec([], tf.float32)))


def picked(model):
    """The loss and metric functions Keras chose for the compiled strings ("accuracy", ...)."""
    ms = model.compiled_loss.metrics + model.compiled_metrics.metrics
    return [f"{m.name}:{getattr(getattr(m, '_fn', None), '__name__', type(m).__name__)}" for m in ms]


results = {}
for name, (build, x, y) in CASES.items():
    runs = {}
    for how in ("hvdtrain", "keras"):
        tf.keras.utils.set_random_seed(1)
        model = build()
        data = tokens_dataset().padded_batch(32) if x is None else tf.data.Dataset.from_tensor_slices((x, y))
        if how == "hvdtrain":
            hvdtrain.fit(model, data, epochs=1, batch_size=32, output_dir=tempfile.mkdtemp(),
                         auto_resume=False, checkpoint_every=0, save_model=False, tensorboard=False, verbose=0)
        else:
            model.fit(data if x is None else data.batch(32), epochs=1, verbose=0)
        runs[how] = {"metrics": picked(model), "traces": int(model.train_function.experimental_get_tracing_count())}
    results[name] = runs


def ops(fn, grads, variables) -> dict:
    concrete = fn.get_concrete_function(grads, variables)
    count = collections.Counter(op.type for op in concrete.graph.get_operations())
    for f in concrete.graph._functions.values():
        count.update(node.op for node in f.definition.node_def)
    return dict(count)


def traced(fn, grads, variables):
    """(ops built, calls AutoGraph converted) while tracing `fn`."""
    tf.autograph.set_verbosity(1, alsologtostdout=True)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        built = ops(fn, grads, variables)
    tf.autograph.set_verbosity(0)
    return built, log.getvalue().count("Converted call:")


model = user_models.small_bn_cnn((8, 8, 1), 10)
grads = [tf.TensorSpec(v.shape, v.dtype) for v in model.trainable_variables]
allreduce = {}
for who in ("horovod", "hvdtrain"):
    for compression in ("none", "fp16"):
        if who == "horovod":
            opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(), compression=optimizer._compression(
                config.Config(compression=compression)))
        else:
            opt = optimizer.distributed(tf.keras.optimizers.SGD(), config.Config(compression=compression))
        built, converted = traced(opt._allreduce_grads, grads, model.trainable_variables)
        allreduce[f"{who}-{compression}"] = {"ops": built, "autograph_converted": converted}

if world.is_chief:
    print("RESULT " + json.dumps({"size": runtime.world().size, "models": results, "allreduce": allreduce}),
          flush=True)
