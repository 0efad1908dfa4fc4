"""This project's example PyTorch ring (examples/torch_ring.py) as a peer: run
beside the others as a control, the harness and the kit agree with a correct ring."""

from examples.torch_ring import TorchRing


class ExampleRing(TorchRing):
    """examples/torch_ring.py's TorchRing under a peer key."""
    key, library = "examples/torch_ring", "striped-attention"
    conventions = "examples.torch_ring"          # the module whose docstring CONFORMANCE.md quotes
