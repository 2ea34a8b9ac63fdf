"""Command line of android_bridge: ``python -m android_bridge export --model NAME --out DIR``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from collections.abc import Sequence


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


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command; returns the process exit status."""
    parser = argparse.ArgumentParser(prog="python -m android_bridge")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write encoder.pte, encoder.pt, train_step.pte, manifest")
    ex.add_argument("--model", help="a tasks dataset name (its default model) or one of "
                    "android_bridge.models.MODELS; default: the federation's default task")
    ex.add_argument("--out", required=True, help="output folder (created)")
    ex.add_argument("--config", help="JSON file of DGCConfig fields (selection must be exact) "
                    "over the federation's default config")
    ex.add_argument("--batch-size", type=int, help="default: the federation's batch_size")
    ex.add_argument("--learning-rate", type=float, help="default: the federation's lr")
    ex.add_argument("--max-numel", type=int,
                    help="largest tensor the encoder takes; default: export.DEFAULT_MAX_NUMEL")
    ex.add_argument("--seed", type=int, default=0)
    ex.add_argument("--verbose", action="store_true",
                    help="show the export toolchain's own warnings and notices")
    args = parser.parse_args(argv)
    if not args.verbose:
        quiet_toolchain()
    # Imported after the filters: importing the toolchain already logs.
    from android_bridge.export import DEFAULT_MAX_NUMEL, export_all, federation_defaults
    from dgc.config import DGCConfig
    from dgc.errors import DGCError

    try:
        fields = federation_defaults()["config"].to_dict()
        if args.config:
            with open(args.config) as f:
                fields.update(json.load(f))
        config = DGCConfig.from_dict(fields)
        manifest = export_all(args.model, args.out, config, batch_size=args.batch_size,
                              learning_rate=args.learning_rate, seed=args.seed,
                              max_numel=args.max_numel or DEFAULT_MAX_NUMEL)
    except (DGCError, OSError, json.JSONDecodeError) as e:
        print(f"export failed: {e}", file=sys.stderr)
        return 2
    files = [manifest[k]["file"] for k in ("encoder", "torchscript", "training")]
    print(f"wrote {', '.join(files)} and manifest.json to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
