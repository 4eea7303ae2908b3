"""keras.io's transfer-learning recipe as a user writes it: train a new head on a frozen base, then
unfreeze the base, recompile at a lower learning rate and fit again (fine-tuning). Run two ways:

    transfer_learning.py plain OUT             single-process Keras on the global batch, lr scaled by hand
    transfer_learning.py hvdtrain OUT [OUT2]   hvdtrain.init()/fit() on every rank; phase 2 in OUT2 if given

KILL=phase1|between|phase2 kills every rank (SIGKILL, as an OOM killer or `kill -9` would) after the
first epoch of phase 1, between the phases, or after the first epoch of phase 2. SECOND_SCRIPT=1 runs
phase 2 alone, as a second script would, on a model freshly built. Rank 0 writes the final weights
to OUT/weights.npz and prints RESULT with what each phase trained at.
"""
import json
import os
import signal
import sys

import hvdtrain

mode, out = sys.argv[1], sys.argv[2]
out2 = sys.argv[3] if len(sys.argv) > 3 else out
world = hvdtrain.init() if mode == "hvdtrain" else None

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

keras = tf.keras
GLOBAL_BATCH, STEPS, EPOCHS = 64, 20, 3
workers = world.size if world else 2  # plain Keras stands for 2 workers: the global batch, lr x 2
kill = os.environ.get("KILL")


class KillAfterFirstEpoch(keras.callbacks.Callback):
    """Dies at the start of the second epoch, once the first one's checkpoint is written."""

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def fit(model, phase: int):
    """One phase: plain Keras on the global batch at the scaled lr, or hvdtrain.fit on this rank."""
    x_, y_ = x[:GLOBAL_BATCH * STEPS], y[:GLOBAL_BATCH * STEPS]
    dies = [KillAfterFirstEpoch()] if kill == f"phase{phase}" else []
    if world is None:
        lr = model.optimizer.learning_rate
        lr.assign(lr * workers)
        return model.fit(x_, y_, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history["loss"]
    summary = hvdtrain.fit(model, (x_, y_), epochs=EPOCHS, batch_size=GLOBAL_BATCH // world.size, shuffle=False,
                           warmup_epochs=0, val_split=0, output_dir=out if phase == 1 else out2, verbose=0,
                           tensorboard=False, callbacks=dies)
    return summary["history"]["lr"]


keras.utils.set_random_seed(3)
x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32")

# a "pre-trained" base (keras.applications' weights would be downloaded: a small one, seeded)
base = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                         keras.layers.Dense(16, activation="relu")], name="base")
inputs = keras.Input((64,))
outputs = keras.layers.Dense(10)(base(inputs, training=False))
model = keras.Model(inputs, outputs)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
ran = {}

if not os.environ.get("SECOND_SCRIPT"):
    # phase 1: the base frozen, the new head trains
    base.trainable = False
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss, metrics=["accuracy"])
    ran["phase1"] = fit(model, 1)
    if kill == "between":
        os.kill(os.getpid(), signal.SIGKILL)

# phase 2: fine-tuning, everything trains, at a lower learning rate
base.trainable = True
model.compile(optimizer=keras.optimizers.Adam(1e-4), loss=loss, metrics=["accuracy"])
ran["phase2"] = fit(model, 2)

if world is None or world.is_chief:
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, "weights.npz"), *model.get_weights())
    print("RESULT " + json.dumps({"weights": os.path.join(out, "weights.npz"), **ran}), flush=True)
