"""pytest's fixtures and hooks for the suite; the helpers that launch jobs are in jobs.py."""
import pytest


@pytest.fixture
def out(tmp_path):
    return tmp_path
