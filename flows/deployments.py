"""Prefect deployments of the scanforest flows: one table used by ``scanforest serve``,
``scanforest run`` and ``deploy/prefect.yaml`` (whose entries mirror it)."""
from __future__ import annotations

import importlib
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

    def load_flow(self):
        module, attr = self.entrypoint.split(":")
        return getattr(importlib.import_module(module), attr)

    @property
    def flow_name(self) -> str:
        return self.load_flow().name

    @property
    def full_name(self) -> str:
        return f"{self.flow_name}/{self.name}"


DEPLOYMENTS: dict[str, DeploymentSpec] = {
    d.name: d
    for d in (
        DeploymentSpec("ingest", "scanforest.flows.ingest:ingest_flow",
                       "Ingest new scans from a drop folder or archive into the store (resumable).",
                       cron="*/30 * * * *"),
        DeploymentSpec("describe", "scanforest.flows.describe:describe_flow",
                       "Normals, keypoints, frames and SHOT352 for scans not yet described.",
                       cron="15 * * * *"),
        DeploymentSpec("index-build", "scanforest.flows.match:index_build_flow",
                       "Build (or keep, when unchanged) the sharded KD-forest index over the model library."),
        DeploymentSpec("match", "scanforest.flows.match:match_flow",
                       "Match described scans against the index; writes top-k ids and distances.",
                       cron="30 * * * *"),
        DeploymentSpec("align", "scanforest.flows.align:align_flow",
                       "Parametric chamfer alignment of scan pairs (PChA, GPU when present)."),
    )
}


def get(name: str) -> DeploymentSpec:
    spec = DEPLOYMENTS.get(name) or next((d for d in DEPLOYMENTS.values() if d.full_name == name), None)
    if spec is None:
        raise InputError(f"unknown deployment {name!r}; known: {', '.join(sorted(DEPLOYMENTS))}")
    return spec


def runner_deployments(names: list[str] | None = None, *, parameters: dict[str, Any] | None = None,
                       schedules: bool = True):
    """``RunnerDeployment`` objects for ``prefect.serve`` (module entrypoints, so any cwd works)."""
    from prefect.deployments.runner import EntrypointType

    out = []
    for name in names or list(DEPLOYMENTS):
        spec = get(name)
        out.append(spec.load_flow().to_deployment(
            name=spec.name, description=spec.description, cron=spec.cron if schedules else None,
            parameters={**spec.parameters, **(parameters or {})},
            entrypoint_type=EntrypointType.MODULE_PATH, tags=["scanforest"]))
    return out
