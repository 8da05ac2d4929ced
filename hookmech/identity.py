"""Model identity: `model_hash`, the SHA-256 of a model's config and weights.

Two models with the same config and the same tensors have the same hash, however and wherever
their checkpoint files were written (the file's bytes also hold metadata such as the version
that wrote it). Checkpoints store it in the metadata key ``hookmech_model_hash`` and caches in
the root attribute ``model_hash``; patching a model with a cache of another model is refused.

Definition (version 1): SHA-256 over, in order,

* the config as canonical JSON (``json.dumps(config, sort_keys=True, separators=(",", ":"))``,
  UTF-8) and a newline;
* for each ``state_dict`` entry in sorted-name order: the line ``name<TAB>dtype<TAB>shape\\n``
  (dtype as torch names it without ``torch.``, e.g. ``float32``; shape as comma-separated
  integers, empty for a scalar), then the tensor's bytes in memory (C order; little-endian on
  the platforms torch runs on).

The ``state_dict`` holds the parameters and the persistent buffers; non-persistent buffers
(constants a mixer derives from its config, e.g. long convolutions' positions) are not part of
it and so not of the hash. A tied LM head appears once per ``state_dict`` name, as saved.
"""

from __future__ import annotations

import hashlib
import json

import torch


def canonical_config_json(config_json: str) -> str:
    """Return a config's JSON text in canonical form (sorted keys, no spaces)."""
    return json.dumps(json.loads(config_json), sort_keys=True, separators=(",", ":"))


def model_hash(model) -> str:
    """Return the hex SHA-256 identifying `model` (a `HookedLM`): its config and its
    ``state_dict`` tensors, as the module docstring defines (not any file's bytes)."""
    return state_hash(model.cfg.to_json(), model.state_dict())


def state_hash(config_json: str, state: dict[str, torch.Tensor]) -> str:
    """Return the hex SHA-256 of a config (JSON text) and a state dict, as `model_hash`."""
    digest = hashlib.sha256()
    digest.update(canonical_config_json(config_json).encode() + b"\n")
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        shape = ",".join(str(size) for size in tensor.shape)
        digest.update(f"{name}\t{dtype}\t{shape}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()
