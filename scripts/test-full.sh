#!/usr/bin/env bash
# The full tier: every test marked `full` (both stacks' matrices, the launchers, Slurm, 32 ranks, the
# compose cluster, the bench's sections, the soak, the kill-and-relaunch variants), run as scripts/test.sh
# runs the gate. It records what each test that passed reached in tests/full_tier.json: commit that
# file, and the gate runs only the full-tier tests that a later change reaches (tests/tiers.py).
set -euo pipefail
cd "$(dirname "$0")/.."
if (($#)); then
  echo "scripts/test-full.sh takes no arguments (a partial run records nothing); for some tests: scripts/test.sh ARGS" >&2
  exit 2
fi
HVDTRAIN_TIER=full exec bash scripts/test.sh
