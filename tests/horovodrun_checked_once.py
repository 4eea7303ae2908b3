"""horovodrun for the tests' launches: Horovod's own launcher (horovod.runner.launch), with its build
check answered from what the test session asked of this venv's horovod.tensorflow once
(jobs.HOROVOD_BUILT). horovodrun asks it at every launch, in a forked child that imports
horovod.tensorflow, and so TensorFlow: about 4 s of CPU per launch, a few hundred times a run.
Everything else is horovodrun's; the commands of the docs and of the multi-host, Slurm, scale and elastic
tests run horovodrun itself, check included."""
import json
import os
import sys

from horovod.runner import launch

if __name__ == "__main__":  # horovodrun's helpers start processes that import this file again
    built = json.loads(os.environ["HVDTRAIN_TEST_HOROVOD_BUILT"])
    launch.mpi_built = lambda verbose=False: built["mpi"]
    launch.gloo_built = lambda verbose=False: built["gloo"]
    sys.exit(launch.run_commandline())
