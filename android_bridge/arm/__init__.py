"""The emulated arm64 phone: build it (``build_rootfs.sh``, ``make arm``), run Python in it
(:mod:`android_bridge.arm.emulator`) and what it runs (:mod:`android_bridge.arm.inside`)."""
