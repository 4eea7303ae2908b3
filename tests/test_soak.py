"""Many short jobs in a row: each one must succeed and leave nothing behind (no process, no port)."""
import json
import os

import psutil
import pytest

from jobs import LAUNCHERS, launch, processes_of

pytestmark = [pytest.mark.alone, pytest.mark.full]  # no process or port may be left

# 6 in the suite (2 per launcher, about a minute); the soak is HVDTRAIN_SOAK_JOBS=30 (7.5 min)
JOBS = int(os.environ.get("HVDTRAIN_SOAK_JOBS", "6"))
TINY = ("-m", "hvdtrain", "--model", "mlp", "--data", "digits", "--epochs", "1", "--steps-per-epoch", "2",
        "--verbose", "0", "--no-tensorboard", "--no-save-model", "--no-keep-best", "--checkpoint-every", "0")


def _listening():
    return {(c.laddr.ip, c.laddr.port) for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN}


@pytest.mark.soak
@pytest.mark.timeout(1500)
def test_short_jobs_in_a_row_all_succeed_and_leak_no_process_or_port(tmp_path):
    ports_before = _listening()
    for i in range(JOBS):
        launcher, out = LAUNCHERS[i % len(LAUNCHERS)], tmp_path / f"job{i}"
        proc = launch(2, launcher, [*TINY, "--output-dir", str(out)], timeout=180)
        assert proc.returncode == 0, f"job {i} ({launcher}): {proc.stdout[-3000:]}"
        assert json.loads((out / "summary.json").read_text())["world_size"] == 2
        assert processes_of(out) == [], f"job {i} ({launcher}) left processes behind"
    leaked = _listening() - ports_before
    assert not leaked, f"ports still listening after {JOBS} jobs: {sorted(leaked)}"
