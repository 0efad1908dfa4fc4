"""Framework harnesses: a ring written in PyTorch or JAX, driven by the kit one example at a time.

Each imports its framework only when used, so `import reference.testing` needs
NumPy alone (the guide: docs/kit.md). Modules, in reading order:

    torch         `TorchAdapter`: a persistent gloo world per world size; the user writes one rank's part
    jax           N CPU devices, the user's function under shard_map
"""
