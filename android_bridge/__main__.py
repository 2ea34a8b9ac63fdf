"""Command line of android_bridge: ``python -m android_bridge export --model NAME --out DIR``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from android_bridge.export import DEFAULT_MAX_NUMEL, export_all, federation_defaults
from android_bridge.models import MODELS
from dgc.config import DGCConfig
from dgc.errors import DGCError


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command; returns the process exit status."""
    parser = argparse.ArgumentParser(prog="python -m android_bridge")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write encoder.pte, encoder.pt, train_step.pte, manifest")
    ex.add_argument("--model", help=f"a tasks dataset name (its default model) or one of "
                    f"{sorted(MODELS)}; default: the federation's default task")
    ex.add_argument("--out", required=True, help="output folder (created)")
    ex.add_argument("--config", help="JSON file of DGCConfig fields (selection must be exact) "
                    "over the federation's default config")
    ex.add_argument("--batch-size", type=int, help="default: the federation's batch_size")
    ex.add_argument("--learning-rate", type=float, help="default: the federation's lr")
    ex.add_argument("--max-numel", type=int, default=DEFAULT_MAX_NUMEL)
    ex.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        fields = federation_defaults()["config"].to_dict()
        if args.config:
            with open(args.config) as f:
                fields.update(json.load(f))
        config = DGCConfig.from_dict(fields)
        manifest = export_all(args.model, args.out, config, batch_size=args.batch_size,
                              learning_rate=args.learning_rate, seed=args.seed,
                              max_numel=args.max_numel)
    except (DGCError, OSError, json.JSONDecodeError) as e:
        print(f"export failed: {e}", file=sys.stderr)
        return 2
    files = [manifest[k]["file"] for k in ("encoder", "torchscript", "training")]
    print(f"wrote {', '.join(files)} and manifest.json to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
