"""The benchmarks: ``scanforest bench <name>``, one module per bench.

Each public module defines ``register(app, bench)`` and adds its ``bench`` command (found by
:mod:`scanforest.deploy.cli`); the ``_``-prefixed modules are what they share: the report
(:mod:`._common`) and the data and timer (:mod:`._data`). A bench measures its figures and its
baseline in the same run and never imports another bench's module.
"""
