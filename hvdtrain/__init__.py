"""hvdtrain: data-parallel Keras training on Horovod's ring-allreduce.

    import hvdtrain                      # first: it sets TensorFlow's and MPI's measured defaults
    hvdtrain.init()                      # hvd.init, pin this worker's GPU, before building the model
    model = build_and_compile_my_model()
    summary = hvdtrain.fit(model, my_dataset, epochs=10, output_dir="runs/mine")

The same code path as `python -m hvdtrain`; run the script with python, horovodrun or mpirun.
A loop of your own takes the same steps: hvdtrain.init(), hvdtrain.DistributedOptimizer(opt),
hvdtrain.broadcast(model, opt), hvdtrain.shard(dataset), and world.is_chief for rank 0's side effects.
"""
__version__ = "0.1.0"

from .runtime import set_fast_defaults as _set_fast_defaults

_set_fast_defaults()  # read once by TensorFlow and MPI: before the user's script imports them

from .callbacks import on_rank0  # noqa: E402
from .config import UserError  # noqa: E402
from .data import DataContext  # noqa: E402
from .train import DistributedOptimizer, broadcast, fit, init, shard  # noqa: E402

__all__ = ["init", "fit", "DistributedOptimizer", "broadcast", "shard", "on_rank0", "DataContext", "UserError"]
