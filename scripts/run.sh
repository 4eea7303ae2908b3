#!/usr/bin/env bash
# Set everything up (idempotent), then train the default job on 2 workers on this machine.
# Extra arguments go to hvdtrain, e.g.: scripts/run.sh --model cnn --epochs 5
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
exec .venv/bin/horovodrun -np "${NP:-2}" -H "localhost:${NP:-2}" .venv/bin/python -m hvdtrain "$@"
