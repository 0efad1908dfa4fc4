"""The peers' libraries, imported once by the PyTorch harness's forkserver
(`TorchAdapter.preload`) before it forks the ranks: a world started after a
peer raised then starts in a fraction of a second, not the seconds these
imports take."""

import ring_attention_pytorch  # noqa: F401
import ringmaster.ring.loop  # noqa: F401
import ringmaster.ring.zigzag  # noqa: F401
import yunchang.ring.ring_pytorch_attn  # noqa: F401
from torch.distributed.tensor.experimental._context_parallel import _attention  # noqa: F401

from .ring_flash_attn_adapter import load_rings

load_rings()

import warnings  # noqa: E402

# torch 2.13 warns at every all_gather_into_tensor / reduce_scatter_tensor the peers call
warnings.filterwarnings("ignore", message=r"`torch\.distributed\..*` is deprecated", category=FutureWarning)
