"""Horovod's TF2 MNIST example (examples/tensorflow2/tensorflow2_mnist.py), its loop kept as written,
with hvdtrain's building blocks where Horovod's stand: init, DistributedOptimizer, broadcast, shard,
and rank 0 alone saving the checkpoint. sklearn's digits (8x8) stand for MNIST so that it runs in
seconds; one worker takes all the steps, N workers each 1/N of them, as Horovod's example does.

    custom_loop_script.py OUT [STEPS [INIT]]   under a launcher, or plain python for one worker

STEPS: one worker's steps (600); INIT: hvdtrain.init's keys as JSON (a test's short hang bound). Every
rank writes its pid in OUT as it starts and its weights as it ends; rank 0 prints RESULT: the workers,
the steps each took, and the accuracy on held-out digits.
"""
import json
import os
import sys

import hvdtrain

out, steps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 600
world = hvdtrain.init(**json.loads(sys.argv[3] if len(sys.argv) > 3 else "{}"))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

os.makedirs(out, exist_ok=True)
with open(os.path.join(out, f"pid-{world.rank}"), "w") as fh:
    fh.write(str(os.getpid()))
tf.keras.utils.set_random_seed(1)
x, y = load_digits(return_X_y=True)
x = (x / 16.0).reshape(-1, 8, 8, 1).astype("float32")
(train_x, train_y), (test_x, test_y) = (x[:1500], y[:1500]), (x[1500:], y[1500:])

dataset = tf.data.Dataset.from_tensor_slices((tf.cast(train_x, tf.float32), tf.cast(train_y, tf.int64)))
dataset = hvdtrain.shard(dataset).repeat().shuffle(1000, seed=world.rank).batch(32)

mnist_model = tf.keras.Sequential([
    tf.keras.Input((8, 8, 1)),
    tf.keras.layers.Conv2D(16, [3, 3], activation="relu"),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(64, activation="relu"),
    tf.keras.layers.Dense(10, activation="softmax"),
])
loss = tf.losses.SparseCategoricalCrossentropy()

# Horovod: adjust learning rate based on number of workers.
opt = hvdtrain.DistributedOptimizer(tf.keras.optimizers.Adam(0.001 * world.size))
checkpoint = tf.train.Checkpoint(model=mnist_model, optimizer=opt)
# Horovod: broadcast initial variable states from rank 0 to all other processes.
hvdtrain.broadcast(mnist_model, opt)


@tf.function
def training_step(images, labels):
    with tf.GradientTape() as tape:
        probs = mnist_model(images, training=True)
        loss_value = loss(labels, probs)
    grads = tape.gradient(loss_value, mnist_model.trainable_variables)
    opt.apply_gradients(zip(grads, mnist_model.trainable_variables))  # averaged over the workers
    return loss_value


# Horovod: adjust number of steps based on number of workers.
steps = steps // world.size
for batch, (images, labels) in enumerate(dataset.take(steps)):
    loss_value = training_step(images, labels)
    if batch % 100 == 0 and world.local_rank == 0:
        print("Step #%d\tLoss: %.6f" % (batch, loss_value), flush=True)

# Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting it.
if world.is_chief:
    checkpoint.save(os.path.join(out, "checkpoints", "ckpt"))
np.savez(os.path.join(out, f"weights-{world.rank}.npz"), *mnist_model.get_weights())
if world.is_chief:
    accuracy = float(np.mean(np.argmax(mnist_model.predict(test_x, verbose=0), -1) == test_y))
    print("RESULT " + json.dumps({"workers": world.size, "steps": int(opt.iterations.numpy()),
                                  "accuracy": accuracy}), flush=True)
