"""Triton's Python backend in the worker: model.py files run in-process.

loader.py imports a model.py (with `triton_python_backend_utils` registered),
instance.py runs one instance's initialize / execute / finalize on the batches
the scheduler forms, bls.py sends a model's BLS requests through the scheduler.
"""
