#!/usr/bin/env bash
# Set up everything hvdtrain needs on a Debian machine, idempotently:
# OpenMPI (apt), a .venv with the pinned stack, Horovod built against that TensorFlow, hvdtrain (editable).
# A second call finds the stamp up to date and returns in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.hvdtrain-setup
WANT=$(cat setup.py scripts/setup.sh | sha256sum | cut -c1-16)

apt_install() {
  local missing=()
  command -v mpirun >/dev/null || missing+=(openmpi-bin)
  command -v mpicxx >/dev/null || missing+=(libopenmpi-dev)
  command -v ssh >/dev/null || missing+=(openssh-client)
  command -v cmake >/dev/null || missing+=(cmake)
  command -v g++ >/dev/null || missing+=(g++)
  command -v "$PY" >/dev/null || missing+=(python3)
  "$PY" -c "import ensurepip" 2>/dev/null || missing+=(python3-venv)
  "$PY" -c "import os, sysconfig; assert os.path.exists(sysconfig.get_paths()['include'] + '/Python.h')" \
    2>/dev/null || missing+=(python3-dev)
  if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]} (apt)"
    if [ "$(id -u)" -ne 0 ]; then
      echo "setup: need root to apt-get install ${missing[*]}; run: sudo apt-get install -y ${missing[*]}" >&2
      exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

apt_install

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi

[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
$PIP install -q --upgrade "pip<25" "setuptools<70" wheel
# TensorFlow first: Horovod compiles its TensorFlow ops against the installed TensorFlow.
TF_SPEC=${HVDTRAIN_TF:-tensorflow-cpu==2.15.1}
$PIP install -q "$TF_SPEC" "numpy<2" "mpi4py>=3.1,<5"
if ! $VENV/bin/python -c "import horovod.tensorflow as h; assert h.mpi_built() and h.gloo_built()" 2>/dev/null; then
  echo "setup: building horovod==0.28.1 against TensorFlow (a few minutes the first time; pip caches the wheel)"
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
  HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    $PIP install -q --no-build-isolation horovod==0.28.1
fi
$PIP install -q -e ".[dev]"
echo "$WANT" > "$STAMP"
echo "setup: ready ($($VENV/bin/python -c 'import tensorflow as tf, horovod; print("tensorflow", tf.__version__, "horovod", horovod.__version__)' 2>/dev/null))"
