"""Version 0 of a run's model as a phone holds it before its first task, named by digest.

A phone's export bakes the model's initial parameters into ``train_step.pte``
(``torch.manual_seed(seed)`` then the task's ``build_model``, as the server builds version 0).
When the export's seed is the run's, those parameters *are* version 0, so a phone's first task
can be a patch on version 0, as a ``client.app`` client that builds version 0 itself is sent,
instead of the dense model. A run with the int8 broadcast starts from version 0 rounded to its
grid (:func:`dgc.int8_grid.round_initial`), which the phone can compute.

The export writes both forms' digests in its manifest (``initial_model``); the phone offers them
to the bridge (``FetchTaskRequest.initial_model_sha256``); the bridge sends the patch only when
the version 0 the server's patch applies to has one of those digests (``base_sha256`` in the
reply says which), and the dense model otherwise. A digest is the SHA-256 of the model encoded as
a dense float32 wire-format update, tensors in name order: equal digests, equal bits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

import dgc
from dgc import SparseUpdate
from dgc.int8_grid import round_initial

__all__ = ["FORMS", "initial_digests", "initial_form", "model_digest"]

#: The forms of version 0, by the manifest key of their digest.
FORMS = ("sha256", "int8_grid_sha256")


def _tensors(model: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(np.asarray(model[k], dtype=np.float32)) for k in sorted(model)}


def model_digest(model: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of ``model`` (name -> tensor or array) as a dense float32 wire-format
    update of sequence 0, tensors in name order."""
    data = dgc.encode(SparseUpdate.from_dense(_tensors(model), "float32", 0))
    return hashlib.sha256(data).hexdigest()


def initial_digests(model: Mapping[str, Any]) -> dict[str, str]:
    """The digests of ``model`` as built and rounded to the int8 broadcast grid (:data:`FORMS`)."""
    tensors = _tensors(model)
    return {"sha256": model_digest(tensors), "int8_grid_sha256": model_digest(
        round_initial(tensors))}


def initial_form(model: Mapping[str, Any], digest: str) -> dict[str, np.ndarray] | None:
    """``model`` in the form whose digest is ``digest`` (as built, or on the int8 grid), as
    float32 arrays; None when neither form has it."""
    tensors = _tensors(model)
    for form in (tensors, round_initial(tensors)):
        if model_digest(form) == digest:
            return {k: v.numpy().copy() for k, v in form.items()}
    return None
