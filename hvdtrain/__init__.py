"""hvdtrain: data-parallel Keras training on Horovod's ring-allreduce.

    import hvdtrain                      # first: it sets TensorFlow's and MPI's measured defaults
    hvdtrain.init()                      # hvd.init, pin this worker's GPU, before building the model
    model = build_and_compile_my_model()
    summary = hvdtrain.fit(model, my_dataset, epochs=10, output_dir="runs/mine")

The same code path as `python -m hvdtrain`; run the script with python, horovodrun or mpirun.
"""
__version__ = "0.1.0"

from .runtime import set_fast_defaults as _set_fast_defaults

_set_fast_defaults()  # read once by TensorFlow and MPI: before the user's script imports them

from .callbacks import on_rank0  # noqa: E402
from .config import UserError  # noqa: E402
from .data import DataContext  # noqa: E402
from .train import fit, init  # noqa: E402

__all__ = ["init", "fit", "on_rank0", "DataContext", "UserError"]
