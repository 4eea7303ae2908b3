"""Your own training script, made data-parallel by hvdtrain's Python API.

    python examples/train_script.py [EPOCHS [OUTPUT_DIR]]                    # one worker
    horovodrun -np 2 -H localhost:2 python examples/train_script.py          # two, or mpirun -np 2 ...

The model and the data are the script's own (a Keras model compiled as usual, a tf.data pipeline);
hvdtrain.fit shards the data, scales the learning rate, wraps the optimizer in Horovod's
DistributedOptimizer, starts every worker from the same weights, checkpoints, and writes
runs/train-script/summary.json, exactly as `python -m hvdtrain` would.
"""
import sys

import hvdtrain  # first: it sets TensorFlow's and MPI's measured defaults before they load
import tensorflow as tf
from sklearn.datasets import load_digits

world = hvdtrain.init()  # hvd.init and this worker's GPU (or CPU threads): before building the model


def dataset(ctx: hvdtrain.DataContext):
    """Called on every worker with its context: this one shards and batches the data itself."""
    d = load_digits()
    x, y = (d.images / 16.0).astype("float32")[..., None], d.target
    train = tf.data.Dataset.from_tensor_slices((x[:1500], y[:1500]))
    val = tf.data.Dataset.from_tensor_slices((x[1500:], y[1500:]))
    train = train.shard(ctx.num_workers, ctx.rank).shuffle(1500, seed=ctx.seed).batch(ctx.batch_size)
    return train, val.shard(ctx.num_workers, ctx.rank).batch(ctx.batch_size)


model = tf.keras.Sequential([
    tf.keras.layers.Input((8, 8, 1)),
    tf.keras.layers.Conv2D(16, 3, activation="relu"),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(10, activation="softmax"),
])
model.compile(optimizer=tf.keras.optimizers.Adam(2e-3), loss="sparse_categorical_crossentropy",
              metrics=["accuracy"])

epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
output_dir = sys.argv[2] if len(sys.argv) > 2 else "runs/train-script"
summary = hvdtrain.fit(model, dataset, epochs=epochs, output_dir=output_dir)
if world.is_chief:
    print(f"validation accuracy {summary['metrics']['val_accuracy']:.3f} with {summary['world_size']} worker(s)")
