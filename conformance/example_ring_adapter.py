"""This project's example PyTorch ring (examples/torch_ring.py) as a peer: run
beside the others as a control, the harness and the kit agree with a correct ring."""

from examples.torch_ring import TorchRing


class ExampleRing(TorchRing):
    """examples/torch_ring.py's TorchRing under a peer key. It masks by position
    (k <= q, causal), so causal padding keys (positions >= S, after every real
    query) are never seen; it has no key mask, so its full rows take no padding;
    its padding queries attend: the harness's `loss_ignores_padding`."""
    key, library = "examples/torch_ring", "striped-attention"
    conventions = "examples.torch_ring"          # the module whose docstring CONFORMANCE.md quotes
    masks = ("causal", "full", "padding")
    loss_ignores_padding = True
    no_key_mask = "no key mask (the example ring's mask is causal or none)"
