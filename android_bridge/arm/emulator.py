"""Run Python inside the emulated arm64 phone: ``qemu-aarch64-static -L ROOTFS python3.11``.

The rootfs is built by ``build_rootfs.sh`` (``make arm``) in ``$FEDGC_ARM_CACHE`` (default
``~/.cache/fedgc/arm64/rootfs``). ``qemu -L`` serves absolute paths from the rootfs when they
exist there and from the host otherwise, so the emulated process sees its own ``/usr`` (Debian's
aarch64 Python), ``/opt/fedgc/site`` (the aarch64 wheels) and the emulated CPU's ``/proc/cpuinfo``,
and reads the repository and writes temporary files through the host's paths. It shares the
host's network namespace, so it reaches a bridge listening on the host's loopback.

Emulation costs: ``import torch`` plus ``executorch.runtime`` takes about a minute of CPU on this
x86 machine (ExecuTorch's pybindings import all of ``exir``), so callers run one process that does
many things rather than many processes. Times measured inside say nothing about a phone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: The CPU model qemu emulates: a phone big core (Snapdragon 855, Kirin 980 class); the rootfs's
#: /proc/cpuinfo and sysfs describe the same core.
QEMU_CPU = "cortex-a76"
SITE = "/opt/fedgc/site"
REPO = Path(__file__).resolve().parents[2]


class ArmEnvError(RuntimeError):
    """The emulated environment is missing or a command in it failed."""


def cache_dir() -> Path:
    """``$FEDGC_ARM_CACHE`` or ``~/.cache/fedgc/arm64``."""
    return Path(os.environ.get("FEDGC_ARM_CACHE") or Path.home() / ".cache" / "fedgc" / "arm64")


@dataclass(frozen=True)
class ArmEnv:
    """A built arm64 rootfs and the qemu binary that runs it."""

    rootfs: Path
    qemu: str

    @classmethod
    def find(cls) -> ArmEnv:
        """The cached environment; raises :class:`ArmEnvError` naming what is missing."""
        rootfs = cache_dir() / "rootfs"
        qemu = shutil.which("qemu-aarch64-static")
        if qemu is None:
            raise ArmEnvError("qemu-aarch64-static not found (Debian qemu-user-static); "
                              "run `make arm`")
        if not (rootfs / ".fedgc-stamp").is_file() or not (rootfs / "usr/bin/python3.11").exists():
            raise ArmEnvError(f"no arm64 rootfs in {rootfs}; run `make arm` (or "
                              f"android_bridge/arm/build_rootfs.sh)")
        return cls(rootfs, qemu)

    def command(self, *args: str) -> list[str]:
        """argv that runs ``python3.11 args...`` in the emulated phone."""
        return [self.qemu, "-cpu", QEMU_CPU, "-L", str(self.rootfs),
                str(self.rootfs / "usr/bin/python3.11"), *args]

    def environment(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """A clean environment: only the rootfs's packages and the repository on the path."""
        env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
               "PYTHONPATH": f"{SITE}:{REPO}", "PYTHONHASHSEED": "0", "LANG": "C.UTF-8",
               # one thread, as the host tests run torch and ExecuTorch
               "OMP_NUM_THREADS": "1",
               # for inside.py's flatc wrapper (exec of an aarch64 binary, see there)
               "FEDGC_ARM_ROOTFS": str(self.rootfs), "FEDGC_ARM_QEMU": self.qemu,
               "FEDGC_ARM_CPU": QEMU_CPU}
        env.update(extra or {})
        return env

    def popen(self, *args: str, env: dict[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen:
        """Start ``python3.11 args...`` in the emulated phone."""
        return subprocess.Popen(self.command(*args), env=self.environment(env), cwd=REPO,
                                **kwargs)  # type: ignore[call-overload]

    def run(self, *args: str, env: dict[str, str] | None = None,
            timeout: float = 1800) -> subprocess.CompletedProcess:
        """Run ``python3.11 args...`` to completion; raises :class:`ArmEnvError` on failure with
        the end of its output."""
        proc = subprocess.run(self.command(*args), env=self.environment(env), cwd=REPO,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr)[-4000:]
            raise ArmEnvError(f"emulated python {' '.join(args)} exited {proc.returncode}:\n"
                              f"{tail}")
        return proc
