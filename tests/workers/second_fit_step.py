"""Which step each fit() of one model runs: the first with --reduction adasum, the second without.

Prints the name of the step inside hvdtrain's TrainStep after each fit, and whether the second one is
the model's own (Keras') train_step again, not the first fit's Adasum step."""
import json
import sys

import hvdtrain

hvdtrain.init()
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

out = sys.argv[1]
x = np.random.default_rng(0).standard_normal((256, 8)).astype("float32")
y = (x.sum(1) > 0).astype("int64")
model = tf.keras.Sequential([tf.keras.layers.Input((8,)), tf.keras.layers.Dense(2)])
hvdtrain.fit(model, (x, y), epochs=1, reduction="adasum", output_dir=out, verbose=0)
first = model.train_step.step.__name__
hvdtrain.fit(model, (x, y), epochs=1, output_dir=out, verbose=0)
second = model.train_step.step
print("RESULT " + json.dumps({"first": first, "second": second.__name__,
                              "own": getattr(second, "__func__", None) is tf.keras.Model.train_step}), flush=True)
