#!/usr/bin/env bash
# Set everything up (idempotent), then run the whole test suite. Extra arguments go to pytest,
# e.g. scripts/test.sh -m "not docker" or scripts/test.sh tests/test_config.py
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
