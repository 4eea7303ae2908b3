"""`python -m hvdtrain [train flags]`, or `python -m hvdtrain doctor|bench|hosts ...`.

Alone it is one worker; under horovodrun or mpirun every process runs this same entry point.
"""
import os
import sys

from .config import UserError
from .preemption import EXIT_STATUS, Preempted

COMMANDS = {
    "doctor": "hvdtrain.doctor",
    "bench": "hvdtrain.bench.cli",
    "hosts": "hvdtrain.hosts",
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter, once per worker
    from . import runtime

    runtime.set_fast_defaults()  # before anything imports TensorFlow or starts MPI: both read them once

    try:
        if argv and argv[0] in COMMANDS:
            import importlib

            return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])
        if argv and argv[0] == "train":
            argv = argv[1:]
        from . import config, train

        train.run(config.load(argv))
        return 0
    except UserError as e:
        # every rank meets the same error (config) or has agreed on it (set-up): rank 0 alone reports it
        runtime.say(f"hvdtrain: error: {e}", file=sys.stderr)
        runtime.rank0_first(runtime.Ending.ERROR)
        return 2
    except runtime.TrainingFailed as e:
        # The rank that hit it reports it. When several hit it (a bad label on every shard), rank 0
        # speaks at once and the launcher ends the others on its exit, before they speak.
        runtime.rank0_first(runtime.Ending.FAILED_STEP)
        print(f"hvdtrain: error: {e}", file=sys.stderr, flush=True)
        return 1
    except Preempted as e:
        runtime.rank0_first(runtime.Ending.PREEMPTED)  # rank 0 speaks for all
        runtime.say(f"hvdtrain: {e}", file=sys.stderr)
        return EXIT_STATUS
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
