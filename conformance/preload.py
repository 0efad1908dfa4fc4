"""The peers' libraries, imported once by the PyTorch harness's forkserver
(`TorchAdapter.preload`) before it forks the ranks: a world started after a
peer raised then starts in a fraction of a second, not the seconds these
imports take. The flash-attn stand-in goes in before yunchang, which reads
whether flash-attn is there when it is imported (`HAS_FLASH_ATTN`, globals.py
lines 84-87), and after transformers (ringmaster's Ulysses finds its inner kernel
there), which would take the stand-in for flash-attn and fail on it."""

import transformers.modeling_utils  # noqa: F401

from . import flash_attn_stand_in

flash_attn_stand_in.install()

import ring_attention_pytorch  # noqa: E402, F401
import ringmaster.ring.loop  # noqa: E402, F401
import ringmaster.ring.zigzag  # noqa: E402, F401
import ringmaster.strategies.ulysses  # noqa: E402, F401
import ringmaster.strategies.usp  # noqa: E402, F401
import yunchang  # noqa: E402, F401
from torch.distributed.tensor.experimental._context_parallel import _attention  # noqa: E402, F401

from .ring_flash_attn_adapter import load_rings  # noqa: E402

load_rings()

import warnings  # noqa: E402

# torch 2.13 warns at every all_gather_into_tensor / reduce_scatter_tensor the peers call
warnings.filterwarnings("ignore", message=r"`torch\.distributed\..*` is deprecated", category=FutureWarning)
