"""Deep Gradient Compression as a torch.distributed DDP communication hook (state and hook)."""

from dgc.ddp.hook import dgc_hook
from dgc.ddp.state import DGCState

__all__ = ["DGCState", "dgc_hook"]
