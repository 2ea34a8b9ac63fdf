"""The run's own keys (part ``run``): what it trains, on which clients and data, and where it goes.

Two halves: :class:`RunKeys`, which every train message carries (task, data, partition, seed,
method, clients per round: a client needs them to build its data and its method), and
:class:`RunFolderKeys`, the server's (rounds, the run folder, checkpoints, progress). A key of
the run's that a client needs goes in the first, one only the server reads in the second.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from fedgc.refs import REF as TASK_REF
from fedgc.refs import is_ref
from fedgc.schema import OPTION_KEYS, Check, SettingsError, options_of, setting
from tasks.partition import SCHEMES

__all__ = ["MODEL_NAMES", "PARTITIONS", "TASKS", "RunFolderKeys", "RunKeys", "TaskSpec"]

#: Shipped tasks a run may name (``tasks.DATASETS``); mnist and cifar10 read their files from
#: ``data_dir``. A run may also name a callable of its own, ``module:callable`` (:data:`TASK_REF`).
TASKS = ("mnist5k", "digits", "fashion-mnist", "shakespeare", "mnist", "cifar10")
#: Models a run may name for a shipped task (``tasks.MODELS``); empty = the task's default.
MODEL_NAMES = ("", "mlp", "cnn", "lstm")
#: How the training set is split into clients (``tasks.partition``).
PARTITIONS = SCHEMES


@dataclass(frozen=True)
class _TaskCheck(Check):
    """The ``task`` key's range: a shipped task's name, or ``module:callable``."""

    def accepts(self, value: object) -> bool:
        return value in self.choices or (isinstance(value, str)
                                         and TASK_REF.fullmatch(value) is not None)

    def describe(self) -> str:
        return f"one of {list(self.choices)}, or 'module:callable'"


@dataclass(frozen=True)
class _MethodCheck(Check):
    """The ``method`` key's form: a method's name, or ``module:callable``. Whether a name is
    registered is the registry's to say (:class:`fedgc.settings.RunConfig` asks it, naming the
    registered methods), since these keys import no method."""

    def accepts(self, value: object) -> bool:
        return isinstance(value, str) and (value.isidentifier() or is_ref(value))

    def describe(self) -> str:
        return "a registered method (`python -m simulations methods`), or 'module:callable'"


@dataclass(frozen=True)
class _OptionsCheck(Check):
    """An options key's range: a JSON object of keyword options (checked by options_of)."""

    def describe(self) -> str:
        return "a JSON object, or empty"


class TaskSpec(NamedTuple):
    """The keys that make a run's Task (hashable: clients cache the task by it)."""

    task: str
    model: str
    model_options: str
    data_dir: str
    task_options: str


@dataclass(frozen=True)
class RunKeys:
    """What the run trains and on which clients: sent in every train message."""

    PART = "run"

    task: str = setting("mnist5k", "task", "a shipped dataset with its model "
                        "(tasks.get_task; mnist and cifar10 read data_dir), or your own: "
                        "'module:callable' returning a tasks.Task, called with task_options "
                        "(the module must be importable by every client: PYTHONPATH or "
                        "installed)", _TaskCheck(choices=TASKS))
    task_options: str = setting("", "task_options", "keyword options of the task, a JSON "
                                "object ('{\"n\": 3}'; a TOML table or a dict too): the "
                                "callable's, or a shipped dataset's (test_fraction; "
                                "Shakespeare's seq_len, ...); empty = none", _OptionsCheck())
    model: str = setting("", "model", "model of a shipped task (tasks.MODELS: mlp or cnn for "
                         "images, lstm for shakespeare); empty = the task's default",
                         Check(choices=MODEL_NAMES))
    model_options: str = setting("", "model_options", "constructor options of a shipped "
                                 "task's model, a JSON object like task_options: mlp hidden "
                                 "(list of widths, [200]); cnn channels ([16, 32]), hidden "
                                 "(128); lstm embedding_dim (8), hidden (128), num_layers (2); "
                                 "empty = the defaults", _OptionsCheck())
    data_dir: str = setting("", "data_dir", "local folder of a shipped task's data files: "
                            "required by mnist (IDX files) and cifar10 (python batches), "
                            "replaces fashion-mnist's Debian folder; empty = the packaged "
                            "data")
    num_clients: int = setting(100, "num_clients", "number of data partitions (= clients)",
                               Check(1))
    partition: str = setting("dirichlet", "partition", "how the training set is split",
                             Check(choices=PARTITIONS))
    alpha: float = setting(0.5, "alpha", "Dirichlet concentration (smaller = more label skew)",
                           Check(0.0, low_open=True))
    seed: int = setting(0, "seed", "seed of partitioning, sampling and local shuffling", Check(0))
    method: str = setting("dgc", "method", "the compression method (docs/methods.md: what each "
                          "client sends and the server does), or your own: 'module:callable' "
                          "returning a fedgc.methods.Method (importable by every client, as a "
                          "task)", _MethodCheck())
    clients_per_round: int = setting(10, "clients_per_round", "clients whose updates are "
                                     "aggregated per round", Check(1))

    def check_run_keys(self) -> None:
        """The rules between these keys (their ranges are checked by the engine)."""
        for key in OPTION_KEYS:
            options_of(key, getattr(self, key))
        if self.task not in TASKS:
            shipped_only = [k for k in ("model", "model_options", "data_dir") if getattr(self, k)]
            if shipped_only:
                raise SettingsError(f"{', '.join(shipped_only)} set with task = {self.task!r}: "
                                    f"they configure the shipped tasks {list(TASKS)}; pass your "
                                    f"callable's options in task_options")

    def task_spec(self) -> TaskSpec:
        """The keys that make this run's Task."""
        return TaskSpec(self.task, self.model, self.model_options, self.data_dir,
                        self.task_options)


@dataclass(frozen=True)
class RunFolderKeys:
    """How long the run goes and where its results go: the server's."""

    PART = "run"

    run_name: str = setting("", "run_name", "results go to <results_dir>/<run_name>/; empty: a "
                            "new folder named by the start time, task and method "
                            "(YYYYmmdd-HHMMSS-<task>-<method>; -2, -3... if taken), so a run never "
                            "meets the last one; resume=true needs the name")
    results_dir: str = setting("results", "results_dir", "parent folder of run folders")
    rounds: int = setting(100, "rounds", "server rounds to run (in total, when resuming)",
                          Check(1))
    checkpoint: bool = setting(True, "checkpoint", "write model + strategy state atomically "
                               "after every round")
    resume: bool = setting(False, "resume", "continue from the run folder's checkpoint")
    overwrite: bool = setting(False, "overwrite", "replace an earlier run in the same folder "
                              "(its checkpoint, results and client state)")
    progress: bool = setting(True, "progress", "print one line per round")
    tensorboard: bool = setting(False, "tensorboard", "also write every round's metrics "
                                "(accuracy, loss, MB both ways, clients, seconds) as "
                                "TensorBoard scalars under <run_dir>/tensorboard/ (needs the "
                                "tensorboard package, in the dev extra: pip install -e "
                                "'.[tensorboard]' in the checkout)")

    def check_folder_keys(self) -> None:
        """The rules between these keys."""
        if "/" in self.run_name or self.run_name in (".", ".."):
            raise SettingsError(f"run_name = {self.run_name!r} must be a plain folder name")
        if not self.run_name.isprintable():
            # A newline or an escape sequence in a folder name garbles every line that prints it.
            raise SettingsError(f"run_name = {self.run_name!r} holds a control character; "
                                f"expected a plain folder name")
        if self.resume and not self.run_name:
            raise SettingsError("resume=true needs run_name: the name of the run folder to "
                                "continue (without it, a run starts in a new timestamped folder)")
