"""Prefect deployments of the scanforest flows: one table, the single source of
``scanforest serve``, ``scanforest run`` and ``deploy/prefect.yaml`` (written by
:func:`prefect_yaml`: ``scanforest deployments --yaml > deploy/prefect.yaml``; a test holds the
committed file to it).

Parameters are checked against each flow's signature here, before Prefect sees them: a
deployment given a parameter its flow does not take fails every run (``SignatureMismatchError``),
and one registered without a required parameter gets runs the API refuses (409). Both are a
one-line :class:`InputError` at ``serve`` or ``run`` time instead."""
from __future__ import annotations

import importlib
import inspect
import json
import time
from dataclasses import dataclass, field
from typing import Any

from scanforest.kernels.errors import InputError


@dataclass(frozen=True)
class DeploymentSpec:
    name: str                      # deployment name; the full name is "<flow name>/<name>"
    entrypoint: str                # module path "package.module:flow"
    description: str
    cron: str | None = None        # schedule (UTC); None = run on demand only
    parameters: dict[str, Any] = field(default_factory=dict)
    per_run: tuple[str, ...] = ()  # required parameters each on-demand run may give instead of `serve`

    def load_flow(self):
        module, attr = self.entrypoint.split(":")
        return getattr(importlib.import_module(module), attr)

    @property
    def flow_name(self) -> str:
        return self.load_flow().name

    @property
    def full_name(self) -> str:
        return f"{self.flow_name}/{self.name}"

    def accepts(self) -> list[str]:
        """The flow's parameters, in signature order."""
        return list(inspect.signature(self.load_flow().fn).parameters)

    def required(self) -> list[str]:
        """Parameters without a default in the flow or in this table: every run needs them."""
        sig = inspect.signature(self.load_flow().fn).parameters
        return [k for k, p in sig.items() if p.default is inspect.Parameter.empty and k not in self.parameters]


DEPLOYMENTS: dict[str, DeploymentSpec] = {
    d.name: d
    for d in (
        DeploymentSpec("ingest", "scanforest.flows.ingest:ingest_flow",
                       "Ingest new scans from a drop folder or archive into the store (resumable).",
                       cron="*/30 * * * *"),
        DeploymentSpec("describe", "scanforest.flows.describe:describe_flow",
                       "Normals, keypoints, frames and SHOT352 for scans not yet described (GPU when present).",
                       cron="15 * * * *"),
        DeploymentSpec("index-build", "scanforest.flows.match:index_build_flow",
                       "Build (or keep, when unchanged) the sharded KD-forest index over the model library.",
                       per_run=("reference",)),
        DeploymentSpec("match", "scanforest.flows.match:match_flow",
                       "Match described scans against the index; writes top-k ids and distances.",
                       cron="30 * * * *"),
        DeploymentSpec("recognize", "scanforest.flows.recognize:recognize_flow",
                       "Recognise the model scans in every other scan; detections into the store.",
                       per_run=("models",)),
        DeploymentSpec("align", "scanforest.flows.align:align_flow",
                       "Parametric chamfer alignment of scan pairs (PChA, GPU when present).",
                       per_run=("pairs",)),
        DeploymentSpec("archive", "scanforest.flows.archive:archive_flow",
                       "The whole chain over a store: ingest, describe, index, match, recognize (resumable)."),
    )
}

#: example values of the site's parameters in ``deploy/prefect.yaml`` (operators edit their copy)
SITE_PARAMETERS: dict[str, Any] = {"source": "/data/incoming", "store": "/data/scanforest.zarr"}


def get(name: str) -> DeploymentSpec:
    spec = DEPLOYMENTS.get(name) or next((d for d in DEPLOYMENTS.values() if d.full_name == name), None)
    if spec is None:
        raise InputError(f"unknown deployment {name!r}; known: {', '.join(sorted(DEPLOYMENTS))}")
    return spec


def _missing(spec: DeploymentSpec, given, *, per_run: bool = False) -> str | None:
    """``"NAME needs A, B"`` for the required parameters not in ``given`` (without the table's
    per-run ones when ``per_run``: a run started by hand brings those), else None."""
    need = [k for k in spec.required() if k not in given and not (per_run and k in spec.per_run)]
    return f"deployment {spec.name} needs parameter {', '.join(need)}" if need else None


def runner_deployments(names: list[str] | None = None, *, parameters: dict[str, Any] | None = None,
                       schedules: bool = True, cron: str | None = None):
    """``RunnerDeployment`` objects for ``prefect.serve`` (module entrypoints, so any cwd works).

    Each deployment gets the ``parameters`` its flow takes; one that no served flow takes, or a
    served deployment left without a required parameter, is an :class:`InputError` (its runs
    would all fail). Only a deployment served without a schedule may leave its per-run
    parameters (a model list, scan pairs) to each ``scanforest run``. ``cron`` replaces the
    table's schedule of every served deployment that has one, and schedules the ones named in
    ``names`` too (an on-demand deployment served with every other took a schedule, and with it
    a demand for its per-run parameters: the documented example was refused); an invalid cron
    string is an :class:`InputError` here, not a validation traceback from Prefect."""
    from prefect.deployments.runner import EntrypointType

    specs = [get(n) for n in dict.fromkeys(names or DEPLOYMENTS)]
    parameters = parameters or {}
    taken = {k for spec in specs for k in spec.accepts()}
    unused = [k for k in parameters if k not in taken]
    if unused:
        raise InputError(f"no served deployment ({', '.join(s.name for s in specs)}) takes --param "
                         f"{', '.join(unused)}")
    if cron is not None:
        _check_cron(cron)
    crons = {s.name: (cron if cron and (names or s.cron) else s.cron) if schedules else None for s in specs}
    missing = [m for m in (_missing(s, parameters, per_run=crons[s.name] is None) for s in specs) if m]
    if missing:
        raise InputError(f"{'; '.join(missing)} (give them with --param KEY=VALUE, "
                         "or choose deployments with --only)")
    return [spec.load_flow().to_deployment(
        name=spec.name, description=spec.description,
        cron=crons[spec.name],
        parameters={**spec.parameters, **{k: v for k, v in parameters.items() if k in spec.accepts()}},
        entrypoint_type=EntrypointType.MODULE_PATH, tags=["scanforest", spec.name]) for spec in specs]


def _check_cron(cron: str) -> None:
    """One line for a schedule Prefect would refuse (its CronSchedule's own validation)."""
    from prefect.client.schemas.schedules import CronSchedule

    try:
        CronSchedule(cron=cron)
    except ValueError as exc:  # pydantic's ValidationError: its first message, not its frames
        why = exc.errors()[0]["msg"] if hasattr(exc, "errors") else str(exc).splitlines()[0]
        raise InputError(f"--cron {cron!r} is not a cron schedule: {why}") from None


def api_url() -> str:
    """The Prefect API that ``serve`` and ``run`` talk to, checked to answer: an unset or dead
    URL is one line, not a connection traceback after the client's retries."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise InputError("no Prefect API: set PREFECT_API_URL to the server the deployments are served "
                         "against (e.g. http://127.0.0.1:4200/api)")
    with get_client(sync_client=True) as client:
        exc = client.api_healthcheck()
    if exc is not None:
        raise InputError(f"no Prefect API answers at {url}: {str(exc).splitlines()[0] or type(exc).__name__}")
    return url


def check_run(spec: DeploymentSpec, parameters: dict[str, Any]) -> None:
    """Before ``scanforest run`` waits on a run: the deployment is registered, a process serves it
    (Prefect marks a deployment READY while its ``serve`` process or a worker polls for it), and
    the run gets every parameter its flow needs."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import DeploymentStatus
    from prefect.exceptions import ObjectNotFound

    unknown = [k for k in parameters if k not in spec.accepts()]
    if unknown:
        raise InputError(f"deployment {spec.name} takes no parameter {', '.join(unknown)} "
                         f"(its parameters: {', '.join(spec.accepts())})")
    url = api_url()
    with get_client(sync_client=True) as client:
        try:
            dep = client.read_deployment_by_name(spec.full_name)
        except ObjectNotFound:
            raise InputError(f"deployment {spec.full_name} is not registered at {url}: "
                             f"start `scanforest serve --only {spec.name}`") from None
    if dep.status != DeploymentStatus.READY:
        polled = dep.last_polled.isoformat(timespec="seconds") if dep.last_polled else "never"
        raise InputError(f"no process serves deployment {spec.full_name} (last polled {polled}): "
                         f"start `scanforest serve --only {spec.name}` or a worker of its work pool")
    if dep.paused:
        _check_still_polled(spec, dep)
    missing = _missing(spec, {**dep.parameters, **parameters})
    if missing:
        raise InputError(f"{missing} (give --param KEY=VALUE)")


def _check_still_polled(spec: DeploymentSpec, dep) -> None:
    """A stopped ``serve`` pauses its deployments, and Prefect marks them not ready only a minute
    later: a paused deployment is served only while something still polls it, so wait one polling
    interval (serve's or a worker's, the longer) for its ``last_polled`` to move."""
    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    wait = max(settings.runner.poll_frequency, settings.worker.query_seconds) * 1.5 + 2
    first = dep.last_polled
    deadline = time.monotonic() + wait
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            time.sleep(min(1.0, wait / 10))
            last = client.read_deployment(dep.id).last_polled
            if last is not None and (first is None or last > first):
                return
    polled = first.isoformat(timespec="seconds") if first else "never"
    raise InputError(f"no process serves deployment {spec.full_name}: it is paused and nothing polled it in "
                     f"{wait:.0f} s (last polled {polled}; a stopped `scanforest serve` pauses its deployments): "
                     f"start `scanforest serve --only {spec.name}` or a worker of its work pool")


def await_run(spec: DeploymentSpec, flow_run_id, timeout: float):
    """Wait for a run of ``spec`` that ``scanforest run`` triggered to end, at most ``timeout``
    seconds; the flow run as last read. While the run waits to be picked up (Scheduled), a
    deployment that Prefect marks not ready (nothing polled it for a minute: its ``serve`` process
    was killed, or stopped mid-run without pausing it) ends the wait: the run is cancelled (it
    would otherwise start whenever a serve comes back) and :class:`InputError` says so. Before,
    ``run`` waited its whole ``--timeout`` (an hour by default) and printed "SCHEDULED"."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import DeploymentStatus
    from prefect.states import Cancelled

    t0 = time.monotonic()
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            state = run.state
            if state is not None and state.is_final():
                return run
            if state is not None and state.is_scheduled() and run.deployment_id is not None:
                dep = client.read_deployment(run.deployment_id)
                if dep.status != DeploymentStatus.READY:
                    client.set_flow_run_state(flow_run_id, Cancelled(message="no process serves its deployment"),
                                              force=True)
                    polled = dep.last_polled.isoformat(timespec="seconds") if dep.last_polled else "never"
                    raise InputError(f"no process serves deployment {spec.full_name}: nothing picked up run "
                                     f"{run.name} in {time.monotonic() - t0:.0f} s and Prefect marks the deployment "
                                     f"not ready (last polled {polled}); the run is cancelled: start "
                                     f"`scanforest serve --only {spec.name}` or a worker of its work pool")
            waited = time.monotonic() - t0
            if waited >= timeout:
                return run
            time.sleep(min(1.0 if waited < 10 else 2.0, max(0.05, timeout - waited)))


#: the head of ``deploy/prefect.yaml``: how to deploy it, the work pool and the Dask scheduler
_YAML_HEAD = """\
# Prefect deployments of scanforest (Prefect 3), generated from the table in flows/deployments.py:
#   scanforest deployments --yaml > deploy/prefect.yaml      (edit the table there, not this file)
# Deploy with:
#   prefect work-pool create scanforest --type process     # once
#   prefect --no-prompt deploy --all                       # from this folder
#   prefect worker start --pool scanforest                 # on a machine with scanforest installed
# Flows are loaded by module path, so the worker needs only `pip install scanforest[...]`
# (no code pull). `scanforest serve` serves the same deployments without a work pool.
# The parameter values are examples: set your store and drop folder in your copy.
name: scanforest
prefect-version: 3.8.0

pull: []

definitions:
  work_pool: &pool
    name: scanforest
    work_queue_name: default
    job_variables:
      env:
        PREFECT_SERVER_ANALYTICS_ENABLED: "false"
  cluster: &cluster
    # null = a local cluster on the worker's machine; set to your scheduler, e.g. tcp://dask-scheduler:8786
    scheduler: null

deployments:
"""


def prefect_yaml() -> str:
    """``deploy/prefect.yaml`` for the table: every deployment, its schedule, the example site
    parameters its flow takes, and the shared Dask scheduler for flows that take one. Values
    are written as JSON, which YAML reads as it is."""
    blocks = []
    for spec in DEPLOYMENTS.values():
        takes = spec.accepts()
        params = {**{k: v for k, v in SITE_PARAMETERS.items() if k in takes}, **spec.parameters}
        lines = [f"  - name: {spec.name}",
                 f"    entrypoint: {spec.entrypoint}",
                 f"    description: {json.dumps(spec.description)}",
                 f"    tags: [scanforest, {spec.name}]"]
        lines += (["    schedules:", f"      - cron: {json.dumps(spec.cron)}", "        timezone: UTC"]
                  if spec.cron else ["    schedules: []"])
        lines.append("    parameters:")
        lines += [f"      {k}: {json.dumps(v)}" for k, v in params.items()]
        if "scheduler" in takes:
            lines.append("      <<: *cluster")
        lines.append("    work_pool: *pool")
        blocks.append("\n".join(lines) + "\n")
    return _YAML_HEAD + "\n".join(blocks)
