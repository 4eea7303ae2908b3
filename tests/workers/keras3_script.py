"""A Keras 3 training script as a user writes it, run two ways: `plain` is single-process Keras
(model.fit on the whole batch), `hvdtrain` is the same script through hvdtrain.init()/fit() on every
rank of a job. Rank 0 writes the final weights to OUTPUT_DIR/weights.npz and prints RESULT."""
import json
import os
import sys

import hvdtrain

world = hvdtrain.init() if sys.argv[1] == "hvdtrain" else None

import keras  # noqa: E402  (after init: the GPU is pinned before Keras touches a device)
import numpy as np  # noqa: E402
from keras import layers  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

keras.utils.set_random_seed(3)
x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32")
model = keras.Sequential([keras.Input((64,)), layers.Dense(32, activation="relu"), layers.Dense(10)])
model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
GLOBAL_BATCH, STEPS, EPOCHS = 64, 20, 3
if world is None:
    # two workers' updates are one update on their two batches together, at the scaled learning rate
    model.optimizer.learning_rate.assign(0.1)
    model.fit(x[:GLOBAL_BATCH * STEPS], y[:GLOBAL_BATCH * STEPS], batch_size=GLOBAL_BATCH, epochs=EPOCHS,
              shuffle=False, verbose=0)
else:
    hvdtrain.fit(model, (x[:GLOBAL_BATCH * STEPS], y[:GLOBAL_BATCH * STEPS]), epochs=EPOCHS,
                 batch_size=GLOBAL_BATCH // world.size, shuffle=False, warmup_epochs=0, val_split=0,
                 output_dir=sys.argv[2], verbose=0, tensorboard=False)
if world is None or world.is_chief:
    os.makedirs(sys.argv[2], exist_ok=True)
    np.savez(os.path.join(sys.argv[2], "weights.npz"), *model.get_weights())
    print("RESULT " + json.dumps({"weights": os.path.join(sys.argv[2], "weights.npz"),
                                  "optimizer": type(model.optimizer).__name__}), flush=True)
