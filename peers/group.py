"""N torch.distributed processes (gloo, CPU) serving one example at a time.

    python -m peers.group --world-size N --serve SOCKET        # started by `TorchGroups`

The parent process forks N ranks; they join one gloo process group and serve
requests from the socket (`reference.testing.serve_requests`): a request is
{"peer": key, "case": Case, "shards": {"q": [per rank], "k", "v", "dout"}},
each rank answers `PEERS[key].compute(case, its shard)` (NumPy arrays in the
oracle's conventions). A rank that fails ends every rank; the driver's timeout
ends a group that hangs.
"""

import argparse
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUEST_TIMEOUT_S = 60        # one example, forward and backward, on 2 shared cores (they take 0.1 s)
# Idle ranks wait for the next request inside a gloo broadcast, while the
# driver runs other world sizes' groups: gloo must not time that out. A rank
# stuck in a peer's collective is ended by the driver's request timeout instead
# (ProcessGroup kills the whole group).
GLOO_TIMEOUT_S = 24 * 3600


def rank_main(rank, world_size, socket_path, init_file):
    import torch
    import torch.distributed as dist
    from reference.testing import serve_requests
    from peers import PEERS
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=GLOO_TIMEOUT_S))

    def broadcast(x):
        box = [x]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(x):
        out = [None] * world_size if rank == 0 else None
        dist.gather_object(x, out, dst=0)
        return out

    def handle(request):
        mine = {name: arrays[rank] for name, arrays in request["shards"].items()}
        return PEERS[request["peer"]].compute(request["case"], mine, rank)

    serve_requests(socket_path, rank, handle, broadcast=broadcast, gather=gather)
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--serve", required=True, metavar="SOCKET")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="peers-gloo-") as tmp:
        mp.start_processes(rank_main, args=(args.world_size, args.serve, os.path.join(tmp, "init")),
                           nprocs=args.world_size, start_method="fork")


class TorchGroups:
    """One served group per world size, started on first use, restarted after a failure."""

    def __init__(self, timeout=REQUEST_TIMEOUT_S):
        self.timeout, self.groups = timeout, {}

    def request(self, n, message):
        from reference.testing import ProcessGroup
        group = self.groups.get(n)
        if group is None:
            env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
            group = self.groups[n] = ProcessGroup(
                [sys.executable, "-m", "peers.group", "--world-size", n, "--serve", "{socket}"],
                timeout=self.timeout, env=env, cwd=ROOT)
        try:
            return group.request(message)
        except TimeoutError:
            # killed by ProcessGroup; the next request starts a new one. (A rank
            # that raised is not a reason to restart: every rank replied, so
            # all of them are past the request.)
            self.groups.pop(n, None)
            raise

    def close(self):
        for group in self.groups.values():
            group.close()
        self.groups = {}


if __name__ == "__main__":
    main()
