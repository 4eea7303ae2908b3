#!/usr/bin/env bash
# The static stage: ruff (pyflakes' rules, pycodestyle's errors, bugbear, blind excepts) over the code and
# the tests, and mypy over the package (every function body checked: a call to a module attribute that
# does not exist fails here). Configured in pyproject.toml. Neither needs TensorFlow: they run from a
# small venv of their own (.venv-static, made once in seconds), before the stacks are set up.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-static
TOOLS=("ruff==0.17.6" "mypy==2.4.1")
if [ "$(cat "$VENV/.tools" 2>/dev/null)" != "${TOOLS[*]}" ]; then
  PY=${PYTHON:-$(bash scripts/python_for.sh keras3 || echo python3)}
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${TOOLS[@]}"
  echo "${TOOLS[*]}" > "$VENV/.tools"
fi
echo "static: ruff, mypy"
"$VENV/bin/ruff" check hvdtrain tests examples scripts
"$VENV/bin/mypy"
