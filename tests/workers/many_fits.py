"""Several trainings in one job, one after another, as a script that calls hvdtrain.fit for one model,
then another: one launch (and one TensorFlow import per worker) for the tests of many users' models.

    many_fits.py SPEC.json

SPEC.json maps each run's output dir to hvdtrain.fit's keys (model and data as --model/--data name
them). Each run writes its summary.json and logs/ there, as `python -m hvdtrain` would. Rank 0 prints
RESULT with the runs done.
"""
import json
import sys

import hvdtrain

world = hvdtrain.init()
with open(sys.argv[1]) as fh:
    runs = json.load(fh)
for out, keys in runs.items():
    keys = dict(keys)
    model, data = keys.pop("model"), keys.pop("data")
    hvdtrain.fit(model, data, output_dir=out, **{"verbose": 0, "tensorboard": False, **keys})
if world.is_chief:
    print("RESULT " + json.dumps({"runs": list(runs)}), flush=True)
