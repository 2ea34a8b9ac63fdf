"""Command line of android_bridge: ``export`` the phone files, ``serve`` phones, run a ``phone``.

``python -m android_bridge export --out DIR [--set key=value ...]``, ``python -m android_bridge
serve --devices FILE ...`` (:mod:`android_bridge.serve`), ``python -m android_bridge phone
--export DIR --bridge HOST:PORT ...`` (:mod:`android_bridge.run_phone`); docs/android.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from android_bridge.notices import quiet_toolchain
from android_bridge.run_phone import main as phone
from android_bridge.serve import main as serve


def export_parser() -> argparse.ArgumentParser:
    """The options of ``export``."""
    ex = argparse.ArgumentParser(
        prog="python -m android_bridge export",
        description="Write encoder.pte, encoder.pt, train_step.pte and manifest.json for a run: "
                    "its task (shipped or your own module:callable), method, batch size, lr "
                    "and seed.")
    ex.add_argument("--out", required=True, help="output folder (created)")
    ex.add_argument("--model", help="the run's task (a tasks dataset, or your own "
                    "'module:callable'), or one of android_bridge.models.MODELS; default: the "
                    "run's task (--set task=...)")
    ex.add_argument("--task-options", help="JSON object of the task's options (task_options)")
    ex.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                    help="a run key, as for `python -m simulations run` (repeatable)")
    ex.add_argument("--run-config", metavar="FILE", help="TOML file of run keys")
    ex.add_argument("--config", help="JSON file of DGCConfig fields (selection must be exact) "
                    "over the run method's phone config")
    ex.add_argument("--batch-size", type=int, help="default: the run's batch_size (the largest "
                                                   "batch the training step takes)")
    ex.add_argument("--learning-rate", type=float, help="default: the run's lr")
    ex.add_argument("--max-numel", type=int,
                    help="largest tensor the encoder takes; default: the model's largest")
    ex.add_argument("--seed", type=int, help="default: the run's seed (the training step's "
                                             "parameters are then the run's version 0)")
    ex.add_argument("--verbose", action="store_true",
                    help="show the export toolchain's own warnings and notices")
    return ex


def export(argv: Sequence[str]) -> int:
    """``export``: write the phone files; 2 with one line on a bad option."""
    args = export_parser().parse_args(list(argv))
    if not args.verbose:
        quiet_toolchain()
    # Imported here, after the filters (importing the toolchain logs); start-up without torch.
    from android_bridge.export import (
        DEFAULT_MAX_NUMEL,
        export_all,
        export_run,
        federation_defaults,
    )
    from android_bridge.models import MODELS
    from dgc.config import DGCConfig
    from dgc.errors import DGCError
    from fedgc.schema import load_toml
    from fedgc.settings import RunConfig, SettingsError

    try:
        fields = {}
        if args.config:
            with open(args.config) as f:
                fields = json.load(f)
            if not isinstance(fields, dict):
                raise DGCError(f"--config {args.config} must hold a JSON object of DGCConfig "
                               f"fields")
        if args.model in MODELS:
            if args.set or args.run_config or args.task_options:
                raise DGCError(f"--model {args.model} is a registered model, not a task: "
                               f"--set, --run-config and --task-options do not apply")
            config = DGCConfig.from_dict({**federation_defaults()["config"].to_dict(), **fields})
            manifest = export_all(args.model, args.out, config, batch_size=args.batch_size,
                                  learning_rate=args.learning_rate, seed=args.seed or 0,
                                  max_numel=args.max_numel or DEFAULT_MAX_NUMEL)
        else:
            values: dict[str, object] = load_toml(args.run_config) if args.run_config else {}
            for item in args.set:
                key, sep, value = item.partition("=")
                if not sep or not key.strip():
                    raise SettingsError(f"--set expects key=value, got {item!r}")
                values[key.strip()] = value.strip()
            for key, value in (("task", args.model), ("task_options", args.task_options),
                               ("batch_size", args.batch_size), ("lr", args.learning_rate),
                               ("seed", args.seed)):
                if value is not None:
                    values[key] = value
            manifest = export_run(RunConfig.from_flat(values), args.out,
                                  max_numel=args.max_numel, dgc_fields=fields)
    except (DGCError, SettingsError, OSError, json.JSONDecodeError) as e:
        print(f"export failed: {e}", file=sys.stderr)
        return 2
    files = [manifest[k]["file"] for k in ("encoder", "torchscript", "training")]
    print(f"wrote {', '.join(files)} and manifest.json to {args.out} (model {manifest['model']},"
          f" {sum(p['numel'] for p in manifest['parameters']):,} parameters, batches of 1.."
          f"{manifest['training']['batch_size']})")
    return 0


COMMANDS = {"export": "write the phone files (.pte, .pt, manifest) for a run",
            "serve": "serve phones: the TLS bridge, its control socket, a SuperNode per phone",
            "phone": "a reference phone (this CPU, or the emulated arm64 phone of `make arm`)"}


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a command; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        lines = "\n".join(f"  {name:<7} {doc}" for name, doc in COMMANDS.items())
        print(f"usage: python -m android_bridge {{{','.join(COMMANDS)}}} ...\n\n{lines}\n\n"
              f"`python -m android_bridge COMMAND --help` for its options", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    if argv[0] == "export":
        return export(argv[1:])
    if argv[0] == "serve":
        return serve(argv[1:])

    return phone(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
