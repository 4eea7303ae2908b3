"""A hung rank is named (rank, host, pid) and the job ends with status 75 so that the same command resumes:
a frozen process (SIGSTOP, as a hung driver or a dead mount freezes one) by its silence, a live rank
whose input pipeline or step is blocked by the allreduce it never reaches. A long first step, or a
whole job suspended and continued, is not a hang."""
import json
import os
import re
import signal
import time

import pytest

from jobs import KERAS3, error_lines, launch, pid_of_rank, processes_of, start
from hvdtrain.watchdog import Peer, stuck_bound, verdict

pytestmark = pytest.mark.alone  # a hang is named within a bound of seconds

EPOCHS_OF_20_STEPS = ["--model", "mlp", "--data", "digits", "--steps-per-epoch", "20", "--verbose", "0",
                      "--no-tensorboard"]


def _start(launcher, out, *flags):
    return start(2, launcher, ["-m", "hvdtrain", "--output-dir", str(out), *flags], start_new_session=True)


def _finish(proc, timeout):
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _named_once(output: str) -> str:
    lines = [l for l in output.splitlines() if re.search(r"hvdtrain: rank \d on \S+ \(pid \d+\) has not", l)]
    assert len(lines) == 1, output[-3000:]
    assert "Every rank ends now (exit status 75); the same command resumes from the last checkpoint" in lines[0]
    assert re.search(r"Exit code:\s+75", output), output[-3000:]
    return lines[0]


@pytest.mark.parametrize("launcher,rank,bound", [pytest.param("mpirun", 1, None, marks=pytest.mark.full), ("gloo", 0, 15)])
def test_a_frozen_worker_is_named_within_a_minute_and_the_relaunch_resumes_from_the_last_checkpoint(
        launcher, rank, bound, tmp_path):
    """SIGSTOP to one worker mid-training: every other rank waits in the allreduce, and one line names the
    frozen rank, host and pid (rank 0 names a frozen peer; rank 1 names a frozen rank 0) within about a
    minute at the default bound, or soon after --hang-frozen-seconds; every process of the job is gone, and
    the same command resumes."""
    flags = ["--hang-frozen-seconds", str(bound)] if bound else []
    proc = _start(launcher, tmp_path, *EPOCHS_OF_20_STEPS, "--epochs", "12", *flags)
    try:
        pid = pid_of_rank(tmp_path, rank, proc)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        output = _finish(proc, timeout=120)
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    line = _named_once(output)
    assert f"rank {rank} on " in line and f"(pid {pid}) has not answered for" in line, line
    assert "its process is stopped or stuck in the kernel" in line
    # named at about 50 s (45 s of silence, a 5 s heartbeat), then the launcher ends it
    assert took < (bound or 45) + 30, (took, line)
    assert processes_of(tmp_path, settle=2) == []
    again = launch(2, launcher, ["-m", "hvdtrain", "--output-dir", str(tmp_path), *EPOCHS_OF_20_STEPS, "--epochs", "12"])
    assert again.returncode == 0, again.stdout[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["first_epoch"] > 0 and summary["last_epoch"] == 12
    assert len(set(summary["weights_sha256_by_rank"])) == 1


@pytest.mark.parametrize("launcher,what", [
    ("mpi", "model:userdata:hangs_on_rank_1"),  # its forward pass blocks from the 4th step
    ("gloo", "data:userdata:blobs_blocking_on_rank_1"),  # its input pipeline blocks in epoch 2
    pytest.param("gloo", "model:userdata:hangs_on_rank_1", marks=pytest.mark.stacks),
])
@pytest.mark.full
def test_a_worker_blocked_before_its_allreduce_is_named_and_the_job_ends(launcher, what, tmp_path):
    """A live rank that never reaches the gradients' allreduce (the others wait there for it) is named
    after --hang-stuck-seconds, under both controllers, and every rank exits 75."""
    kind, source = what.split(":", 1)
    flags = {"model": ["--model", source, "--data", "userdata:blobs"],
             "data": ["--model", "userdata:tiny_model", "--num-classes", "2", "--data", source]}[kind]
    t0 = time.monotonic()
    proc = _start(launcher, tmp_path, *flags, "--epochs", "3", "--verbose", "0", "--no-tensorboard",
                  "--hang-stuck-seconds", "8")
    output = _finish(proc, timeout=150)
    line = _named_once(re.sub(r"\[1,\d+\]<std(out|err)>:", "", output))
    assert re.search(r"rank 1 on \S+ \(pid \d+\) has not reached the gradients' allreduce for \d+ s, while "
                     r"rank 0 waits there for it: its input pipeline or its step is blocked", line), line
    assert time.monotonic() - t0 < 120
    assert processes_of(tmp_path, settle=2) == []


@pytest.mark.full
@pytest.mark.parametrize("launcher", ["mpi", pytest.param("gloo", marks=pytest.mark.stacks)])
def test_ranks_that_traced_different_steps_are_named_with_why_and_the_job_ends(launcher, tmp_path):
    """A model whose call branches on the rank: rank 1's gradients have other names, so the two ranks'
    allreduces never meet. Within --hang-collective-seconds one line names both ranks, the collective
    each waits in and what differs in their traced steps; every rank exits 75. Horovod's own stall
    warning (every 60 s, each rank's tensor names) does not come first, and rank 0's progress says that
    no step finishes."""
    t0 = time.monotonic()
    # Keras 2 pairs the ranks' allreduces though a name scope renames rank 1's ops: there, rank 1 trains
    # its head alone (fewer gradients), which parts them as surely
    proc = start(2, launcher, ["tests/workers/apart_script.py", str(tmp_path), "hang_collective_seconds=12",
                               "verbose=1", "log_every=2"], start_new_session=True,
                 env=None if KERAS3 else {"APART": "frozen"})
    output = _finish(proc, timeout=150)
    took = time.monotonic() - t0
    lines = [l for l in output.splitlines() if "hvdtrain: the ranks wait in collectives that never meet" in l]
    assert len(lines) == 1, output[-3000:]
    line = lines[0]
    why = (r"rank 0: first gradient \S+, gradient names \w+; rank 1: first gradient \S*only_on_rank_1\S*, gradient "
           r"names \w+" if KERAS3 else r"rank 0: gradient names \w+; rank 1: gradient names \w+")
    assert re.search(r"rank 0 on \S+ \(pid \d+\), rank 1 on \S+ \(pid \d+\) in the gradients' allreduce of its "
                     r"step 1\. Their steps were traced differently \(" + why + r"\)", line), line
    assert "Every rank ends now (exit status 75)" in line
    assert re.search(r"exit(ed)? with status code 75|Exit code:\s+75", output), output[-3000:]
    assert "Stalled ranks" not in output and "RESULT" not in output
    assert took < 12 + 60, took
    # rank 0's progress meanwhile says that no step finishes, not an estimate from a rate of zero
    quiet = re.findall(r"hvdtrain: epoch 1/2 step [01]/16 .*\| no step finished for (\d+) s", output)
    assert quiet and int(quiet[-1]) >= 10, output[-3000:]
    assert not re.search(r"no step finished .*\n(.*\n)*.*epoch ETA", output), output[-3000:]
    assert processes_of(tmp_path, settle=2) == []


def test_settings_that_differ_between_ranks_are_refused_before_training_by_name(tmp_path):
    """Each rank's own steps_per_execution, or its own model (decided on the rank's view, as a branch on
    the rank in a script would): one error, naming the setting, or the first variable that differs, and
    each rank's value, before any step."""
    proc = launch(2, "gloo", ["tests/workers/apart_script.py", str(tmp_path)],
                  env={"RANK_SETTINGS": "1"}, timeout=120)
    assert proc.returncode != 0
    ours = error_lines(proc.stdout)
    assert len(ours) == 1, proc.stdout[-3000:]
    assert "the ranks decided differently, and would wait forever in collectives that never meet: " \
           "steps per call: rank 0: 1; rank 1: 7 | --steps-per-execution: rank 0: 1; rank 1: 7. Give every rank " \
           "the same settings, callbacks and data" in ours[0], ours[0]
    # a model built otherwise on one rank: refused before rank 0's weights are broadcast (Horovod
    # broadcasts them one by one, in order), naming the first variable that differs
    proc = launch(2, "gloo", ["tests/workers/apart_script.py", str(tmp_path / "model")],
                  env={"RANK_MODEL": "1"}, timeout=120)
    ours = error_lines(proc.stdout)
    assert proc.returncode != 0 and len(ours) == 1, proc.stdout[-3000:]
    assert re.search(r"branching's weights, before rank 0 broadcasts them: the ranks decided differently, .*"
                     r"the model's variables: rank 0: 4 in all, #1 float32 \(8, 16\)( \S+)?; rank 1: 4 in all, #1 "
                     r"float32 \(8, 17\)", ours[0]), ours[0]


@pytest.mark.full
def test_a_long_first_step_on_one_rank_is_not_a_hang(tmp_path):
    """Rank 0's first step takes 8 s (a long trace or XLA compile) while rank 1 waits in the allreduce,
    with both bounds at 3 s: the job trains to the end."""
    proc = launch(2, "gloo", ["-m", "hvdtrain", "--model", "userdata:slow_first_step_on_rank_0", "--data",
                              "userdata:blobs", "--epochs", "2", "--verbose", "0", "--no-tensorboard",
                              "--output-dir", str(tmp_path), "--hang-stuck-seconds", "3", "--hang-frozen-seconds", "3"],
                  env={"SLOW_FIRST_STEP": "8"})
    assert proc.returncode == 0 and "has not" not in proc.stdout, proc.stdout[-3000:]


@pytest.mark.full
def test_a_whole_job_suspended_and_continued_is_not_a_hang(tmp_path):
    """Every worker stopped for longer than the bound, then continued (a scheduler's suspend and
    resume, a laptop's Ctrl-Z and fg): no rank is named, training goes on to the end."""
    proc = _start("mpirun", tmp_path, *EPOCHS_OF_20_STEPS, "--epochs", "15", "--hang-frozen-seconds", "4")
    try:
        pids = [pid_of_rank(tmp_path, r, proc) for r in (0, 1)]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(12)
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        output = _finish(proc, timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0 and "has not answered" not in output, output[-3000:]


# ---------------------------------------------------------------- the judgement itself

def _peers(*arrived, seen=100.0, busy=None):
    return [Peer(r, "node1", 1000 + r, seen, a, busy if r == 0 else None) for r, a in enumerate(arrived)]


def test_the_ranks_behind_are_named_only_once_nobody_has_moved_for_the_bound():
    assert verdict(_peers(5, 4, 5), now=100, frozen_s=45, stuck_s=10, moved=89).startswith(
        "rank 1 on node1 (pid 1001) has not reached the gradients' allreduce for 11 s, while ranks 0, 2 wait")
    assert verdict(_peers(5, 4, 5), now=100, frozen_s=45, stuck_s=10, moved=95) is None  # not yet
    assert verdict(_peers(5, 5, 5), now=100, frozen_s=45, stuck_s=10, moved=0) is None  # equal: validating, say
    assert verdict(_peers(5, 0, 5), now=100, frozen_s=45, stuck_s=10, moved=60) is None  # its first step:
    assert verdict(_peers(5, 0, 5), now=100, frozen_s=45, stuck_s=10, moved=49).startswith("rank 1 ")  # 5 bounds
    assert verdict(_peers(4, 5, busy="writing a checkpoint"), now=100, frozen_s=45, stuck_s=10, moved=0) is None
    assert verdict(_peers(5, 4), now=100, frozen_s=45, stuck_s=0, moved=0) is None  # 0: off


def test_silence_names_a_frozen_rank_but_not_one_that_never_connected_or_has_ended():
    peers = _peers(3, 3, 3)
    peers[2].seen = 50.0
    assert verdict(peers, now=100, frozen_s=45, stuck_s=0, moved=100) == (
        "rank 2 on node1 (pid 1002) has not answered for 50 s: its process is stopped or stuck in the kernel")
    assert verdict(peers, now=100, frozen_s=0, stuck_s=0, moved=100) is None  # 0: off
    peers[2].gone = True
    assert verdict(peers, now=100, frozen_s=45, stuck_s=0, moved=100) is None
    peers[2].gone, peers[2].seen = False, None
    assert verdict(peers, now=100, frozen_s=45, stuck_s=0, moved=100) is None


def test_the_default_stuck_bound_is_three_minutes_or_fifty_median_steps_whichever_is_longer():
    assert stuck_bound(None, []) == 180.0
    assert stuck_bound(None, [0.01, 0.02, 5.0]) == 180.0
    assert stuck_bound(None, [6.0, 7.0, 8.0]) == 350.0
    assert stuck_bound(12.0, [6.0]) == 12.0 and stuck_bound(0.0, [6.0]) == 0.0


def test_ranks_all_waiting_in_collectives_are_named_once_the_last_has_waited_the_bound():
    peers = _peers(3, 3)
    peers[0].waiting, peers[0].waited = "the epoch's end (hvdtrain.epoch_end, the metrics' allreduce)", 70.0
    peers[1].waiting, peers[1].waited = "the gradients' allreduce of its step 3", 61.0
    assert verdict(peers, now=100, frozen_s=45, stuck_s=0, moved=0, collective_s=60) == (
        "the ranks wait in collectives that never meet, for 61 s: rank 0 on node1 (pid 1000) in the epoch's end "
        "(hvdtrain.epoch_end, the metrics' allreduce); rank 1 on node1 (pid 1001) in the gradients' allreduce of its "
        "step 3")
    peers[1].waited = 59.0  # not yet: the last to arrive may still be met
    assert verdict(peers, now=100, frozen_s=45, stuck_s=0, moved=0, collective_s=60) is None
    peers[1].waiting = None  # one rank computes: not apart (the stuck bound's case)
    assert verdict(peers, now=100, frozen_s=45, stuck_s=0, moved=0, collective_s=60) is None


def test_ranks_waiting_in_one_collective_traced_alike_are_told_the_names_differ():
    peers = _peers(1, 1)
    for p in peers:
        p.waiting, p.waited, p.traced = "the gradients' allreduce of its step 1", 90.0, {"steps per call": 10}
    line = verdict(peers, now=100, frozen_s=45, stuck_s=0, moved=0, collective_s=60)
    assert line.endswith("Horovod matches a collective by its name in each rank's traced step: something in the "
                         "step or the model differs between the ranks"), line
    peers[1].traced = {"steps per call": 7}
    assert verdict(peers, now=100, frozen_s=45, stuck_s=0, moved=0, collective_s=60).endswith(
        "Their steps were traced differently (rank 0: steps per call 10; rank 1: steps per call 7)")
    assert verdict(peers, now=100, frozen_s=45, stuck_s=0, moved=0, collective_s=0) is None  # 0: off
