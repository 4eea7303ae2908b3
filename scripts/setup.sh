#!/usr/bin/env bash
# Set up everything hvdtrain needs on a Debian machine, idempotently:
# OpenMPI (apt), a venv with one of the two stacks, Horovod built against that TensorFlow, hvdtrain (editable).
# A second call finds the stamp up to date and returns in about a second.
#
# The stack (HVDTRAIN_STACK overrides; PYTHON picks the interpreter, default python3):
#   keras3  TensorFlow 2.18.1, Keras 3, numpy 2: Python 3.10-3.12 (the default wherever it runs);
#           on Python 3.13 TensorFlow 2.21.0 (2.20.0 for GPUs), Horovod built with one line of its own changed (below)
#   keras2  TensorFlow 2.15.1, Keras 2 (tf.keras), numpy<2: Python 3.9-3.11
# HVDTRAIN_VENV names the venv (default .venv), so both stacks can live side by side.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${HVDTRAIN_VENV:-.venv}
STAMP=$VENV/.hvdtrain-setup

apt_install() {
  local missing=()
  command -v mpirun >/dev/null || missing+=(openmpi-bin)
  command -v mpicxx >/dev/null || missing+=(libopenmpi-dev)
  command -v ssh >/dev/null || missing+=(openssh-client)
  command -v cmake >/dev/null || missing+=(cmake)
  command -v make >/dev/null || missing+=(make)
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

# Horovod 0.28.1's source, with hvdtrain's fixes to its build, each checked to have applied:
# - GCC 13 and later no longer include <string> and <stdexcept> through other standard headers, as two of
#   Horovod's headers assume (GCC 12, Debian bookworm's, still does);
# - GCC 14 refuses the copy assignment of flatbuffers' span (bundled by Horovod) outright, as it assigns
#   a const member; no code calls it, so that line goes;
# - TensorFlow 2.20+: horovod/tensorflow/xla_mpi_ops.cc (Horovod's XLA kernels, for GPU builds only)
#   includes TensorFlow's XLA headers, which want highwayhash and farmhash headers TensorFlow's wheel does
#   not ship. That file is left out of such builds: CPU builds compiled none of it but its includes, and
#   GPU builds lose only XLA's way to the allreduce (hvdtrain then refuses --jit-compile; see compiling.py).
horovod_source() {
  local tf_version=$1 src
  src=$(mktemp -d)
  $PIP download -q --no-deps --no-binary :all: -d "$src" horovod==0.28.1
  tar xzf "$src"/horovod-0.28.1.tar.gz -C "$src"
  src=$src/horovod-0.28.1
  fix() {  # fix FILE SED-SCRIPT LINE-THAT-MUST-THEN-BE-THERE
    sed -i "$2" "$src/$1"
    grep -qxF "$3" "$src/$1" || { echo "setup: $1 is not as expected; cannot build Horovod" >&2; exit 1; }
  }
  fix horovod/common/group_table.h 's/^#include <mutex>$/&\n#include <string>/' '#include <string>'
  fix horovod/common/common.h 's/^#include <memory>$/&\n#include <stdexcept>/' '#include <stdexcept>'
  fix third_party/flatbuffers/include/flatbuffers/stl_emulation.h \
    's|^    count_ = other.count_;$|    /* count_ is const (hvdtrain) */|' '    /* count_ is const (hvdtrain) */'
  if [[ "$tf_version" != 2.1[0-9].* ]]; then
    fix horovod/tensorflow/xla_mpi_ops.cc 's/^#if TENSORFLOW_VERSION >= 2006000000$/& \&\& TENSORFLOW_VERSION < 2020000000/' \
      '#if TENSORFLOW_VERSION >= 2006000000 && TENSORFLOW_VERSION < 2020000000'
  fi
  echo "$src"
}

# Which stack this Python can run, and which one was asked for (today's wherever the Python allows).
PYVER=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
case "$PYVER" in
  3.9) CAN="keras2" ;;
  3.10|3.11) CAN="keras3 keras2" ;;
  3.12|3.13) CAN="keras3" ;;
  *) CAN="" ;;
esac
STACK=${HVDTRAIN_STACK:-${CAN%% *}}
if [ -z "$CAN" ] || [[ " $CAN " != *" $STACK "* ]]; then
  case "$STACK" in keras2) WORKS=python3.11 ;; *) WORKS=python3.12 ;; esac
  echo "setup: Python $PYVER ($PY) cannot run the ${STACK:-keras3} stack: keras3 needs Python 3.10-3.13, keras2" \
       "Python 3.9-3.11; point setup at one: PYTHON=$WORKS scripts/setup.sh" >&2
  exit 2
fi
case "$STACK $PYVER" in
  "keras3 3.13") TF_DEFAULT="tensorflow-cpu==2.21.0"; PINS=("numpy>=2" "keras>=3.5,<4" tensorboard) ;;  # TF 2.21 no longer brings it
  keras3*) TF_DEFAULT="tensorflow-cpu==2.18.1"; PINS=("numpy>=2,<2.1" "keras>=3.5,<4") ;;
  keras2*) TF_DEFAULT="tensorflow-cpu==2.15.1"; PINS=("numpy<2") ;;
esac
# The bench's plots (matplotlib) on the keras2 stack only: Keras 3 imports matplotlib.pyplot at start-up
# wherever it is installed (half a second of every worker's start); `pip install matplotlib` draws them.
case "$STACK" in keras2) EXTRAS="dev,plots" ;; *) EXTRAS="dev" ;; esac
# A GPU host, or HVDTRAIN_NCCL=1 (an image built where no GPU is), gets TensorFlow's CUDA build (with pip's
# CUDA, cuDNN and NCCL wheels), unless HVDTRAIN_TF says otherwise. On Python 3.13 that is TensorFlow 2.20:
# Horovod's GPU build against 2.21 compiles but does not load (its ops call stream_executor's
# AsGpuStreamValue, which 2.21 no longer has; conda-forge patches Horovod's code for it).
if [ "${HVDTRAIN_NCCL:-}" = 1 ] || { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; }; then
  TF_DEFAULT=${TF_DEFAULT/tensorflow-cpu==2.21.0/tensorflow-cpu==2.20.0}
  TF_DEFAULT=${TF_DEFAULT/tensorflow-cpu==/tensorflow[and-cuda]==}
fi
TF_SPEC=${HVDTRAIN_TF:-$TF_DEFAULT}
# (what decides the collectives is in the stamp too: a toolkit installed since, or HVDTRAIN_NCCL, rebuilds)
WANT=$( (cat setup.py pyproject.toml scripts/setup.sh scripts/horovod_build.py
         echo "$STACK $PYVER $TF_SPEC ${HVDTRAIN_NCCL:-auto} ${HOROVOD_CUDA_HOME:-} ${CUDA_HOME:-} $(command -v nvcc)") \
       | sha256sum | cut -c1-16)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi

# A venv of another stack or Python is made anew (Horovod is built against one TensorFlow).
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.hvdtrain-stack" 2>/dev/null)" != "$STACK $PYVER" ]; then
  echo "setup: $VENV holds another stack or Python; making it anew for the $STACK stack on Python $PYVER"
  rm -rf "$VENV"
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check"
$PIP install -q --upgrade pip "setuptools<70" wheel  # Horovod 0.28.1 builds with setuptools<70
# TensorFlow first: Horovod compiles its TensorFlow ops against the installed TensorFlow.
$PIP install -q "$TF_SPEC" "${PINS[@]}" "mpi4py>=3.1,<5"
# Which collectives: NCCL too where TensorFlow is a CUDA build and a CUDA toolkit of its major version is
# here; a GPU host without one is told what to get (scripts/horovod_build.py). Exports Horovod's build
# variables and HVDTRAIN_COLLECTIVES (cpu, or nccl-cudaX.Y).
BUILD_PLAN=$(TF_CPP_MIN_LOG_LEVEL=2 "$VENV/bin/python" scripts/horovod_build.py "$VENV/.nccl-link") || exit 1
eval "$BUILD_PLAN"
echo "setup: $HVDTRAIN_COLLECTIVES_SAID"
WANT_BUILT="h.mpi_built() and h.gloo_built()"
[ "$HVDTRAIN_COLLECTIVES" = cpu ] || WANT_BUILT="$WANT_BUILT and h.nccl_built()"
# Horovod's wheel is built once per TensorFlow, Python and collective set, and kept (pip's own cache would
# hand a wheel built against another TensorFlow of the same Python to the other stack).
if ! "$VENV/bin/python" -c "import horovod.tensorflow as h; assert $WANT_BUILT" 2>/dev/null; then
  TF_VERSION=$("$VENV/bin/python" -c 'import tensorflow as tf; print(tf.__version__)' 2>/dev/null)
  SUFFIX=""; [ "$HVDTRAIN_COLLECTIVES" = cpu ] || SUFFIX="-$HVDTRAIN_COLLECTIVES"
  WHEELS=${HVDTRAIN_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain}/horovod-0.28.1-tf$TF_VERSION-py$PYVER$SUFFIX
  TAG=cp${PYVER/./}
  if [ -z "$SUFFIX" ] && [ -n "${HVDTRAIN_HOROVOD_WHEEL_DIR:-}" ] && ls "$HVDTRAIN_HOROVOD_WHEEL_DIR"/horovod-0.28.1-$TAG-*.whl >/dev/null 2>&1; then
    WHEELS=$HVDTRAIN_HOROVOD_WHEEL_DIR  # a wheel built for this TensorFlow and Python (docker/wheels)
  fi
  if ! ls "$WHEELS"/horovod-0.28.1-$TAG-*.whl >/dev/null 2>&1; then
    echo "setup: building horovod==0.28.1 against TensorFlow $TF_VERSION, $HVDTRAIN_COLLECTIVES (a few minutes, once; kept in $WHEELS)"
    SOURCE=$(horovod_source "$TF_VERSION")
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
      $PIP wheel -q --no-cache-dir --no-deps --no-build-isolation -w "$WHEELS" "$SOURCE"
  fi
  $PIP install -q --force-reinstall --no-deps "$WHEELS"/horovod-0.28.1-$TAG-*.whl
  $PIP install -q horovod==0.28.1  # its own requirements
  "$VENV/bin/python" -c "import horovod.tensorflow as h; assert $WANT_BUILT" \
    || { echo "setup: the Horovod built lacks what was asked for ($WANT_BUILT); see the build's output above" >&2; exit 1; }
fi
$PIP install -q -e ".[$EXTRAS]" "${PINS[@]}"
# What the user installs into the venv later (pip install pandas) keeps the stack: pip reads the venv's
# own pip.conf, whose constraints hold TensorFlow, Keras and numpy where this stack has them.
"$VENV/bin/python" - "$VENV" <<'PY'
import importlib.metadata as md, os, sys
venv = os.path.abspath(sys.argv[1])
pins = [f"{d}=={md.version(d)}" for d in ("tensorflow-cpu", "tensorflow", "keras", "numpy", "horovod")
        if any(x.metadata["Name"].lower().replace("_", "-") == d for x in md.distributions())]
open(os.path.join(venv, "constraints.txt"), "w").write("\n".join(pins) + "\n")
open(os.path.join(venv, "pip.conf"), "w").write(f"[global]\nconstraint = {venv}/constraints.txt\n")
PY
echo "$STACK $PYVER" > "$VENV/.hvdtrain-stack"
echo "$WANT" > "$STAMP"
echo "setup: ready in $VENV: the $STACK stack ($("$VENV/bin/python" -c 'import tensorflow as tf, keras, horovod, numpy; print("Python", __import__("platform").python_version(), "tensorflow", tf.__version__, "keras", keras.__version__, "numpy", numpy.__version__, "horovod", horovod.__version__)' 2>/dev/null))"
