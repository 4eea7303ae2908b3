#!/usr/bin/env bash
# Set everything up (idempotent), then run the tests: the whole suite on the default stack (.venv), then,
# where this machine has a Python for it, the tests of what differs between the two Keras generations
# (marker `stacks`) on the other stack, in .venv-keras2 or .venv-keras3.
# Extra arguments go to pytest on the default stack alone: scripts/test.sh -m "not docker",
# scripts/test.sh tests/test_config.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/static.sh  # seconds, before minutes of set-up: a red run says why in its first lines
bash scripts/setup.sh
if (($#)); then
  exec .venv/bin/python -m pytest "$@"
fi
status=0
# Two tests at a time where each compares only what its own jobs computed; one at a time where a test
# times what it runs or shares hosts, ports, daemons or the venv (marker `alone`). Two cores: the second
# test runs while the first waits on a launcher's start, a one-worker reference or a job's exit.
.venv/bin/python -m pytest -n 2 --dist loadfile -m "not alone" || status=$?
.venv/bin/python -m pytest -m alone || status=$?
other=$(.venv/bin/python -c "import tensorflow as tf; print('keras2' if hasattr(tf.keras, 'ops') else 'keras3')")
if py=$(bash scripts/python_for.sh "$other"); then
  echo "test: the $other stack, tests marked 'stacks' (Python $py)"
  PYTHON=$py HVDTRAIN_STACK=$other HVDTRAIN_VENV=.venv-$other bash scripts/setup.sh
  ".venv-$other/bin/python" -m pytest -p no:cacheprovider -n 2 --dist loadfile -m "stacks and not alone" || status=$?
  ".venv-$other/bin/python" -m pytest -p no:cacheprovider -m "stacks and alone" || status=$?
else
  echo "test: no Python for the $other stack on this machine: its tests are not run"
fi
exit $status
