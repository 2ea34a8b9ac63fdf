"""The export toolchain's and the ExecuTorch runtime's notices that a user cannot act on,
silenced where they start."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
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


#: The source file of the lines the runtime's CPU probe logs (``[cpuinfo_utils.cpp:71] Reading
#: file /sys/devices/soc0/image_version``, ``... Failed to open midr file ...``, ``... CPU info
#: and manual query on # of cpus dont match.``).
CPU_PROBE = "[cpuinfo_utils.cpp:"
_threadpool_started = False


def start_threadpool() -> None:
    """Create ExecuTorch's thread pool (once per process) without its CPU probe's notices.

    The runtime creates its thread pool when the first XNNPACK method loads; its CPU probe then
    logs five lines at info level on every machine without the ARM sysfs files it reads (an
    x86 host, qemu's emulated phone): every phone process, and every process of a deployment's
    phones, printed them. The runtime has no switch for its log, so the pool is created here
    with the process's native stderr (file descriptor 2) captured: the probe's lines are
    dropped, any other line is written back.
    """
    global _threadpool_started
    if _threadpool_started:
        return
    from executorch.extension.pybindings import portable_lib

    create = getattr(portable_lib, "_threadpool_get_thread_count", None)
    if create is not None:
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            try:
                create()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().splitlines(keepends=True)
                    if not line.startswith(CPU_PROBE.encode())]
        if kept:
            os.write(2, b"".join(kept))
    _threadpool_started = True
