"""The export toolchain's and the ExecuTorch runtime's notices that a user cannot act on,
silenced where they start."""

from __future__ import annotations

import logging
import warnings


def quiet_toolchain() -> None:
    """Silence the export toolchain's notices that a user of this command cannot act on.

    torch.export's pytree raises a FutureWarning about ``LeafSpec`` once per exported graph node
    kind (20 lines per export), torch logs a deprecation of ``register_constant`` on enums, and
    torchao logs the CUDA kernels it cannot load on a CPU build. None is about fedgc's code or
    the user's input. ``--verbose`` shows them.
    """
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    logging.getLogger("torchao").setLevel(logging.ERROR)
