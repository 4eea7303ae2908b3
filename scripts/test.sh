#!/usr/bin/env bash
# The gate (what CI runs: .ci/run): set everything up (idempotent), then the static stage, every test not
# marked `full`, and every `full` test that reaches a file changed since the full tier last passed it
# (tests/tiers.py, tests/full_tier.json); on the default stack (.venv), then, where this machine has a
# Python for it, the tests marked `stacks` on the other stack (.venv-keras2 or .venv-keras3).
# scripts/test-full.sh runs the full tier the same way (HVDTRAIN_TIER=full).
# Extra arguments go to pytest on the default stack alone, with no tier: scripts/test.sh tests/test_config.py,
# scripts/test.sh -m docker.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=${HVDTRAIN_TIER:-gate}
bash scripts/static.sh  # seconds, before minutes of set-up: a red run says why in its first lines
bash scripts/setup.sh
if (($#)); then
  exec .venv/bin/python -m pytest "$@"
fi
notes=()
if [ "$tier" = full ]; then
  rm -rf .full-tier
  notes=(--record-reach .full-tier)
fi

# One stack's passes: two tests at a time where each compares only what its own jobs computed; one at a
# time where a test times what it runs or shares hosts, ports, daemons or the venv (marker `alone`). Two
# cores: the second test runs while the first waits on a launcher's start, a one-worker reference or a
# job's exit. The gate first says which full-tier tests it adds, and stops if they are too many.
passes() {  # python, --stack-pass value, marker expression (empty: every test)
  local py=$1 pass=$2 expr=${3:+($3) and } rc=0
  # tests/ named: its conftest.py, which loads the tiers' plugin, is then read before the options are
  local args=(tests -p no:cacheprovider --tier "$tier" --stack-pass "$pass" "${notes[@]}")
  if [ "$tier" = gate ]; then
    "$py" -m pytest "${args[@]}" --collect-only -q ${3:+-m "$3"} | grep -v '::' || rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 3 ]; then return 3; fi
  fi
  rc=0
  run "$py" -m pytest "${args[@]}" -n 2 --dist loadfile -m "${expr}not alone" || rc=$?
  run "$py" -m pytest "${args[@]}" -m "${expr}alone" || rc=$?
  return $rc
}

run() {  # a pass that selects no test (exit 5) has nothing to fail
  local rc=0
  "$@" || rc=$?
  [ "$rc" -eq 5 ] && rc=0
  return $rc
}

status=0
passes .venv/bin/python default "" || status=$?
[ "$status" -eq 3 ] && exit 3
other=$(.venv/bin/python -c "import tensorflow as tf; print('keras2' if hasattr(tf.keras, 'ops') else 'keras3')")
if py=$(bash scripts/python_for.sh "$other"); then
  echo "test: the $other stack, tests marked 'stacks' (Python $py)"
  PYTHON=$py HVDTRAIN_STACK=$other HVDTRAIN_VENV=.venv-$other bash scripts/setup.sh
  passes ".venv-$other/bin/python" second stacks || status=$?
else
  echo "test: no Python for the $other stack on this machine: its tests are not run"
fi
if [ "$tier" = full ]; then
  .venv/bin/python tests/tiers.py record .full-tier
fi
exit $status
