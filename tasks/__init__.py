"""Datasets, partitioners and models shared by fedgc's client, server and simulations."""

from tasks.errors import DataError
from tasks.models import MODELS, build_model
from tasks.partition import SCHEMES, label_skew, partition
from tasks.task import DATASETS, Task, get_task

__all__ = [
    "DATASETS",
    "DataError",
    "MODELS",
    "SCHEMES",
    "Task",
    "build_model",
    "get_task",
    "label_skew",
    "partition",
]
