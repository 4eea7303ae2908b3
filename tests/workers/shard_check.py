"""Every rank reads one epoch of its shard; rank 0 reports which sample ids each rank saw.

Usage: shard_check.py DATA BATCH   (samples carry their id as x[0])
"""
import json
import sys

import horovod.tensorflow as hvd

from hvdtrain import config, data, runtime

world = runtime.init()
cfg = config.Config(data=sys.argv[1], batch_size=int(sys.argv[2])).validate()
d = data.load(cfg, world)
ids = [int(v) for x, _ in d.epoch(0) for v in x.numpy().reshape(len(x), -1)[:, 0]]
report = {"ids": hvd.allgather_object(ids), "steps": hvd.allgather_object(d.steps_per_epoch),
          "sharding": d.sharding, "num_samples": d.num_samples}
if world.is_chief:
    print("RESULT " + json.dumps(report), flush=True)
