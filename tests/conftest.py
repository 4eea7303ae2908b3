"""pytest's fixtures and hooks for the suite; the helpers that launch jobs are in jobs.py."""
import os

import pytest

pytest_plugins = ["tiers"]  # the gate and the full tier (tests/tiers.py)

# A fast path that gives way to its slower fallback fails the test instead (runtime.fallback): in this
# process and in every job the tests launch, which inherit the environment. A test that expects a
# fallback names it in HVDTRAIN_EXPECTED_FALLBACKS.
os.environ["HVDTRAIN_NO_FALLBACK"] = "1"


@pytest.fixture
def out(tmp_path):
    return tmp_path
