"""The peers' libraries, imported once by the PyTorch harness's forkserver
(`TorchAdapter.preload`) before it forks the ranks: a world started after a
peer raised then starts in a fraction of a second, not the seconds these
imports take."""

import ring_attention_pytorch  # noqa: F401

from .ring_flash_attn_adapter import load_rings

load_rings()
