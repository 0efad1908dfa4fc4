"""The driver's side of a peer: a `reference.testing.Adapter` whose `run` is
served by a torch.distributed group (`peers.group`), and whose `compute` is
what each rank of that group runs."""

import numpy as np

from reference.testing import Adapter


class PeerAdapter(Adapter):
    """Subclasses set `key`, `library` (the pip name), `name`, the conventions,
    and `compute(case, mine, rank)`: this rank's {"out", "lse", "dq", "dk", "dv"}
    from its shard `mine` ({"q", "k", "v", "dout"} NumPy arrays)."""
    key = library = None
    groups = None              # a peers.group.TorchGroups, set by the runner

    def version(self):
        from importlib.metadata import version
        return version(self.library)

    def run(self, case, shards):
        message = dict(peer=self.key, case=case,
                       shards=dict(q=shards.q, k=shards.k, v=shards.v, dout=shards.dout))
        return self.groups.request(case.n_devices, message)

    def compute(self, case, mine, rank):
        raise NotImplementedError


def to_torch(x, requires_grad=False):
    import torch
    t = torch.from_numpy(np.ascontiguousarray(x))
    return t.requires_grad_(requires_grad)


def to_numpy(t):
    return t.detach().cpu().numpy()
