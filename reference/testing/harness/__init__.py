"""Framework harnesses: a ring written in PyTorch or JAX, driven by the kit one example at a time.

    reference.testing.harness.torch   TorchAdapter: a persistent gloo world per world size;
                                      the user writes what one rank computes from its shard
    reference.testing.harness.jax     the JAX harness: N CPU devices, the user's function under shard_map

Each imports its framework only when used, so `import reference.testing` needs NumPy alone.
"""
