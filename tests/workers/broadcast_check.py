"""Ranks build the same model from different seeds; hvdtrain's broadcast must leave rank 0's weights everywhere."""
import json

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdtrain import models, optimizer, runtime, summary

world = runtime.init()
tf.keras.utils.set_random_seed(1000 + world.rank)
model = models.BUILDERS["mlp"]((8, 8, 1), 10)
model.compile(optimizer=tf.keras.optimizers.Adam(1e-3),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
before = hvd.allgather_object(summary.weights_sha256(model))
optimizer.broadcast_initial_state(model)
after = hvd.allgather_object(summary.weights_sha256(model))
if world.is_chief:
    print("RESULT " + json.dumps({"before": before, "after": after}), flush=True)
