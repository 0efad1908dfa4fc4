"""The model on MPI ranks, every layout in one launch; rank 0 writes the results.

    mpiexec -n N python -m mpi4py tests/support/mpi/model_worker.py SPEC.json RESULTS.npz

SPEC.json: {"config": {...}, "seed", "std", "batch", "seq_len", "period", "tile_size",
"steps"}. Every rank makes the same parameters and tokens from the seeds, takes its
shard through the recipe (`model.train.mpi`), and for each layout rank 0 writes
"<layout>/loss", "<layout>/grad/<name>" (summed over ranks) and "<layout>/curve"
(the losses of `steps` Adam steps on the copy task). tests/model/test_model.py compares
them with the dense model on one process.
"""

import json
import sys

import numpy as np
from mpi4py import MPI

import reference
from model import train, transformer


def main(spec_path, results_path):
    comm = MPI.COMM_WORLD
    with open(spec_path) as f:
        spec = json.load(f)
    config = transformer.Config(**spec["config"])
    tokens = np.random.default_rng(spec["seed"]).integers(0, config.vocab, (spec["batch"], spec["seq_len"] + 1))
    results = {}
    for layout in reference.LAYOUTS:
        replica = train.mpi(config, comm, layout, tile_size=spec["tile_size"], ignore_first=spec["period"] - 1)
        params = transformer.init_params(config, spec["seed"], std=spec["std"])
        loss, grads = replica.loss_and_grads(params, tokens)
        curve, _ = train.train(replica, transformer.init_params(config, spec["seed"]), steps=spec["steps"],
                               batch=spec["batch"], seq_len=spec["seq_len"], period=spec["period"],
                               seed=spec["seed"])
        results[f"{layout}/loss"] = np.array(loss)
        results[f"{layout}/curve"] = curve
        results |= {f"{layout}/grad/{k}": g for k, g in grads.items()}
    if comm.Get_rank() == 0:
        np.savez(results_path, **results)


if __name__ == "__main__":
    main(*sys.argv[1:3])
