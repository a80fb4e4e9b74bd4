"""The operator's side of scanforest: the ``scanforest`` command line (:mod:`scanforest.deploy.cli`),
the benchmarks (:mod:`scanforest.deploy.bench`) and, beside them in this folder, the deployment
specs (``prefect.yaml``, the Dask worker specs) and the benchmarks' external baselines."""
