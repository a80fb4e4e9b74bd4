"""The commands' numeric options, checked as they are parsed: one rule for each option, named as
the user types it (``--normal-k``), in one table (:data:`OPTIONS`).

A bad value used to pass the command line and reach the kernels on the Dask workers 5-9 s into
the command, where it failed under the kernel's own name (``rf_rad must be a positive number``,
``k must be >= 3``) with a failed run left in the store. Every ``int`` and ``float`` option of the
commands takes :func:`scanforest.deploy.cli.core.number` as its callback, which checks the value
here before any flow, cluster or Prefect API starts; the stages' input checks
(:func:`scanforest.flows.inputs.check_recognize_params`, :func:`.library.check_library_build`,
:func:`scanforest.flows.inputs.check_index_build`) check the same parameters with the same rules
for runs started another way (a deployment's parameters). The kernels keep their own checks
(:mod:`scanforest.kernels.validation`), under their arguments' names, for callers of the API.

What depends on the data (``--random-dims`` above the descriptors' dimensions, ``-k`` above an
index's rows, more flow labels than ``--max-labels``) is found where the data is read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from scanforest.kernels.errors import InputError


@dataclass(frozen=True)
class Rule:
    """What one option takes: an integer or a finite real number, within bounds."""

    integer: bool = False
    minimum: float | None = None    # the smallest value taken
    maximum: float | None = None    # the largest value taken
    positive: bool = False          # above 0 (a length, a sigma)
    below: float | None = None      # every value under this one (a recall: below 1)
    note: str = ""                  # why, or what a bound value means (said after the rule)

    def describe(self) -> str:
        """The rule as a message says it: 'a positive finite number', 'at least 3', 'in 1..32',
        'in (0, 1)', 'a finite number >= 0', then the note."""
        if self.positive and self.below is not None:
            text = f"in (0, {self.below:g})"
        elif self.positive:
            text = "positive" if self.integer else "a positive finite number"
        elif self.minimum is not None and self.maximum is not None:
            text = f"in {self.minimum:g}..{self.maximum:g}"
        elif self.minimum is not None:
            text = f"at least {self.minimum:g}" if self.integer else f"a finite number >= {self.minimum:g}"
        else:
            text = "an integer" if self.integer else "a finite number"
        return text + (f" ({self.note})" if self.note else "")

    def holds(self, v) -> bool:
        return ((self.minimum is None or v >= self.minimum) and (self.maximum is None or v <= self.maximum)
                and (not self.positive or v > 0) and (self.below is None or v < self.below))


#: a length in the scans' units (a radius, a sampling, a voxel): positive and finite
LENGTH = Rule(positive=True)
#: a count of at least one
COUNT = Rule(integer=True, minimum=1)

#: every numeric option of the commands (``--workers`` is :func:`scanforest.flows.cluster.check_workers`'s)
OPTIONS: dict[str, Rule] = {
    # describe, shot, library build
    "--normal-k": Rule(integer=True, minimum=3, note="a plane needs 3 neighbours"),
    "--normal-radius": LENGTH,
    "--keypoint-radius": Rule(minimum=0, note="0 = every point"),
    "--shot-radius": LENGTH,
    "--radius": LENGTH,
    "--max-neighbors": COUNT,
    # recognize, archive, library build
    "--model-ss": LENGTH,
    "--scene-ss": LENGTH,
    "--rf-rad": LENGTH,
    "--descr-rad": LENGTH,
    "--voxel": LENGTH,
    "--cg-size": LENGTH,
    "--cg-thresh": Rule(positive=True),
    "--views": Rule(integer=True, minimum=0, note="0 = the model as it is"),
    # index build, library build, match
    "--leaf-size": COUNT,
    "--backtracks": COUNT,
    "--recall": Rule(positive=True, below=1, note="the recall@k the search budget is calibrated for"),
    "--random-dims": Rule(integer=True, minimum=1, maximum=32),  # kernels.knn.kdtree.MAX_RANDOM_DIMS
    "--seed": Rule(integer=True, minimum=0),
    "--graph": Rule(integer=True, minimum=1, maximum=256),
    "--graph-budget": COUNT,
    "--graph-expand": Rule(integer=True, minimum=1, maximum=256),
    "--graph-rounds": Rule(integer=True, minimum=0, maximum=16),
    "-k": Rule(integer=True, minimum=1, maximum=256, note="a search returns at most 256 neighbours a query"),
    # align
    "--huber-delta": LENGTH,
    "--max-iter": COUNT,
    "--resolution": Rule(integer=True, minimum=4, note="distance-transform cells along the largest side"),
    # motion
    "--sigma-c": Rule(positive=True),
    "--sigma-x": Rule(positive=True),
    "--sigma-f": Rule(positive=True),
    "--tau": Rule(minimum=0, note="--no-test switches the change test off"),
    "--max-labels": COUNT,
    "--batch": COUNT,
    # ingest, demo, serve, run
    "--copc-level": Rule(integer=True, minimum=0),
    "--copc-resolution": LENGTH,
    "--scenes": COUNT,
    "--models": COUNT,
    "--points": Rule(integer=True, minimum=100),
    "--limit": COUNT,
    "--timeout": Rule(minimum=0),
}

#: a stage parameter's option where it is not ``--`` and the name with dashes
FLAGS = {"graph_degree": "--graph", "k": "-k"}


def flag(name: str) -> str:
    """The option that sets the stage parameter ``name`` (``rf_rad``: ``--rf-rad``)."""
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def check_option(option: str, value):
    """``value`` of the numeric ``option`` (None: not given, passes), or a user error in one line
    naming the option, its rule and the value: ``--normal-k must be at least 3 (a plane needs 3
    neighbours), got 2``."""
    if value is None:
        return value
    rule = OPTIONS[option]
    if isinstance(value, bool):
        ok = False
    elif rule.integer:
        ok = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    else:
        try:
            ok = math.isfinite(float(value))
        except (TypeError, ValueError):
            ok = False
    if not ok and rule.integer:
        raise InputError(f"{option} must be an integer, got {value!r}")
    if not ok or not rule.holds(int(value) if rule.integer else float(value)):
        raise InputError(f"{option} must be {rule.describe()}, got {value!r}")
    return value


def check_options(params: dict | None, names=None) -> None:
    """Each of ``params`` that an option sets (:func:`flag`; only ``names`` where given), by its
    option's rule: the stages' input checks of a run's parameters."""
    for name, value in (params or {}).items():
        if (names is None or name in names) and flag(name) in OPTIONS:
            check_option(flag(name), value)
