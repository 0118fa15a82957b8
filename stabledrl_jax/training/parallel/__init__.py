"""Parallel: the devices and processes a run spans (docs/pods.md).

``mesh`` lays the devices out as one ``jax.sharding.Mesh`` with axes (data, fsdp, tensor);
``multihost`` starts several processes as one program and says which rows of a global batch each
one holds, reduces host values over them and waits for them at the same points. Nothing here
imports another room of ``training``.
"""
