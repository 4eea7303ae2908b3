"""The run directory a job trains in: one per fit() of a script, a finished run left as it is, and an
earlier run's results moved aside (previous/<time>), never overwritten. Rank 0 looks; all agree."""
from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import time

from . import checkpoint, runtime
from .config import Config


_FITS: collections.Counter = collections.Counter()  # run dir -> the hvdtrain.fit calls of this process that trained there


def own_dir_per_fit(cfg: Config) -> tuple:
    """The n-th fit() of a script on one run dir (transfer learning, then fine-tuning) trains in its
    own sub-directory, run_dir/fit-n: each phase keeps its checkpoints, and the script run again
    finds every phase where it left it (a finished one is restored, an interrupted one resumed)."""
    _FITS[os.path.abspath(cfg.run_dir)] += 1
    n = _FITS[os.path.abspath(cfg.run_dir)]
    if n == 1:
        return cfg, []
    own = dataclasses.replace(cfg, output_dir=os.path.join(cfg.run_dir, f"fit-{n}"))
    return own, [f"fit() {n} of this script on {cfg.run_dir}: it trains in {own.run_dir}"]


def finished_run(cfg: Config):
    """The summary of a run already trained to its last epoch, or None: rank 0 looks, all agree.

    A finished run re-launched with the same command is left alone; a fresh start in a used output
    dir moves the old run's files aside instead of overwriting them."""
    decision = None
    if runtime.world().is_chief:
        path = checkpoint.find(cfg)
        epoch = checkpoint.epoch_of(path) if path else 0
        if path and epoch >= cfg.epochs:
            decision = {**read_summary(cfg), "last_epoch": epoch}
        elif not path:
            keep_previous_run(cfg)
    return runtime.gather(decision)[0]


def say_finished(cfg: Config, summary: dict, what: str):
    runtime.say(f"hvdtrain: already trained to epoch {summary['last_epoch']} of {cfg.epochs} in {cfg.run_dir}: "
                f"{what}; --epochs N (hvdtrain.fit: epochs=N) trains further; --no-auto-resume "
                f"(auto_resume=False) or another --output-dir starts over")


def read_summary(cfg: Config) -> dict:
    path = os.path.join(cfg.run_dir, "summary.json")
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {"run_dir": cfg.run_dir}


OUTPUTS = ("summary.json", "model.keras", "model.weights.h5", "best.weights.h5", "checkpoints")


def keep_previous_run(cfg: Config, keep=(), why="starting afresh"):
    """Rank 0, starting afresh where a run already wrote its results (or about to write results that
    cover fewer epochs than the ones there): move them to previous/<time>, never overwrite them."""
    later_fits = sorted(os.path.basename(d) for d in glob.glob(os.path.join(cfg.run_dir, "fit-[0-9]*")))
    found = [name for name in OUTPUTS if name not in keep and os.path.exists(os.path.join(cfg.run_dir, name))]
    found += later_fits if found and "checkpoints" not in keep else []
    if not found:
        return
    where = os.path.join(cfg.run_dir, "previous", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(where, exist_ok=True)
    for name in found:
        os.replace(os.path.join(cfg.run_dir, name), os.path.join(where, name))
    runtime.say(f"hvdtrain: {why} in {cfg.run_dir}; the previous run's {', '.join(found)} "
                f"moved to {where}")
