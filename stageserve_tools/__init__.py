"""Tools that are not part of the serving runtime: example-model builders.

`stageserve make-examples` and scripts/up.sh write the example repository with
them; tests and benchmarks build their models with them. No service imports
this package.
"""
