"""hvd.elastic's commits under hvdtrain's callbacks, for models compiled with 1 and with 4 steps per call:
the steps at which Horovod's state.commit ran during one 40-step epoch (--commit-every 10)."""
import json

import numpy as np
import tensorflow as tf

import hvdtrain
from hvdtrain import compat, config, optimizer, train

hvdtrain.init()
committed = {}
for per_call in (1, 4):
    model = tf.keras.Sequential([tf.keras.layers.Input((4,)), tf.keras.layers.Dense(1)])
    model.compile("sgd", "mse", steps_per_execution=per_call)
    optimizer.build(model)
    state = compat.elastic_state(model, epoch=0, batch=0)  # Horovod's KerasState on Keras 2
    steps, commit = [], state.commit
    state.commit = lambda steps=steps, model=model, commit=commit: (
        steps.append(int(model.optimizer.iterations.numpy())), commit())
    model.fit(np.zeros((40 * 8, 4)), np.zeros(40 * 8), batch_size=8, epochs=1, verbose=0,
              callbacks=train.elastic_commits(config.Config(commit_every=10), per_call, state))
    committed[per_call] = steps
print("RESULT " + json.dumps(committed), flush=True)
