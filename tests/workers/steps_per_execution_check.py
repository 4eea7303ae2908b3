"""A model compiled with steps_per_execution="auto", trained by hvdtrain.fit: the count it trains with
on each rank, whether Keras' tuner is still on, and what hvdtrain said."""
import json
import tempfile
from pathlib import Path

import hvdtrain
import user_data
import user_models
from hvdtrain import compat, runtime

hvdtrain.init()
model = user_models.auto_steps_regression()
out = Path(tempfile.mkdtemp())
hvdtrain.fit(model, user_data.diabetes()[0], epochs=2, batch_size=16, output_dir=str(out), auto_resume=False,
             checkpoint_every_steps=5, tensorboard=False, verbose=0)
mine = {"steps_per_execution": compat.steps_per_execution(model),
        "tuning": getattr(model, "autotune_steps_per_execution", False)}  # Keras 3 has no tuner
ranks = runtime.gather(mine)
if runtime.world().is_chief:
    print("RESULT " + json.dumps({"ranks": ranks, "log": (out / "logs" / "rank0.log").read_text()}), flush=True)
