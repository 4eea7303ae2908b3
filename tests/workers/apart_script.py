"""A test-only model whose call branches on the rank, so that the ranks trace different steps:
rank 1 runs its layers under a name scope of its own, which renames every gradient Horovod is
given, and the two ranks' allreduces never meet. Run under a launcher:

    apart_script.py OUT [FLAGS...]      hvdtrain.init()/fit(), FLAGS as hvdtrain.fit keys (k=v)

RANK_SETTINGS=1 instead gives each rank its own steps_per_execution (a setting decided on one
rank's view), and RANK_MODEL=1 rank 1 a wider layer: hvdtrain refuses both before training.
"""
import os
import sys

import hvdtrain

out, flags = sys.argv[1], dict(a.split("=", 1) for a in sys.argv[2:])
world = hvdtrain.init()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras = tf.keras


class Branching(keras.Model):
    def __init__(self):
        super().__init__()
        # RANK_MODEL=1: rank 1 builds a wider hidden layer (a model decided on the rank's view)
        width = 17 if os.environ.get("RANK_MODEL") and world.rank == 1 else 16
        self.hidden = keras.layers.Dense(width, activation="relu")
        self.head = keras.layers.Dense(10)
        # built here, outside the branch: the same variables on every rank (Keras 2 would name rank 1's
        # under its scope, and the ranks' weights would differ, which hvdtrain refuses before training)
        self.hidden.build((None, 8))
        self.head.build((None, width))

    def call(self, x):
        if world.rank == 1 and os.environ.get("APART") == "frozen":  # rank 1 trains the head alone
            return self.head(tf.stop_gradient(self.hidden(x)))
        if world.rank == 1:  # a branch on the rank: this rank's ops, and its gradients, have other names
            with tf.name_scope("only_on_rank_1"):
                return self.head(self.hidden(x))
        return self.head(self.hidden(x))


rng = np.random.default_rng(0)
x, y = rng.standard_normal((512, 8)).astype("float32"), rng.integers(0, 10, 512)
model = Branching()
model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
config = {k: int(v) if v.isdigit() else float(v) for k, v in flags.items()}
if os.environ.get("RANK_SETTINGS"):
    config["steps_per_execution"] = 1 if world.rank == 0 else 7
hvdtrain.fit(model, (x, y), epochs=2, batch_size=16, output_dir=out, tensorboard=False, **{"verbose": 0, **config})
print("RESULT trained", flush=True)
