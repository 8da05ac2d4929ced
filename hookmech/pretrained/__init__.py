"""Pretrained models: a Hugging Face model folder (or hub name) loaded into hookmech's own
`HookedLM`, so that every hook, the patching engine, caches, DAS and the view work on it.

``from_pretrained(path)`` reads the folder (`hookmech.pretrained.folder`: ``config.json``, the
weights, never code), picks the family by the config's ``model_type`` (`FAMILIES`), and loads
the family's weights, converted to hookmech's names, strictly into ``HookedLM(cfg)``. Each
family module has ``model_config(hf_config) -> ModelConfig`` and
``convert_weights(hf_config, weights) -> state dict``. The model's `model_hash` covers the loaded
weights and the config, as for any hookmech model.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from ..devices import check_device
from ..errors import HookmechError, UsageError
from .folder import CONFIG_FILE, PretrainedFolder, is_pretrained_folder, read_folder, tokenizer_file
from .weights import WeightsMismatch

# huggingface_hub (optional) and the model (TransformerLens) are imported where used

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..model import HookedLM

#: Hugging Face ``model_type`` -> the module of hookmech.pretrained converting that family
FAMILIES = {"gpt2": "gpt2", "gpt_neox": "gpt_neox", "mamba": "mamba", "mamba2": "mamba2"}
#: compute dtypes a model may be loaded in (`from_pretrained`'s `dtype`)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: what a hub download fetches: the config, safetensors weights and the tokenizer's files
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
#: a hub repository id: ``name`` or ``owner/name``
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
#: endings of files, never of hub names: a missing ``runs/m.safetensors`` is a missing file
_FILE_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".h5", ".json")

__all__ = [
    "DTYPES",
    "FAMILIES",
    "PretrainedFolder",
    "family",
    "from_pretrained",
    "is_hub_name",
    "is_pretrained",
    "is_pretrained_folder",
    "local_folder",
    "read_folder",
    "tokenizer_file",
]


def family(model_type: str, where: str | Path = CONFIG_FILE) -> ModuleType:
    """Return the module converting `model_type` (`FAMILIES`); a HookmechError naming `where`
    (the config file) for a model_type hookmech does not load, or whose module is absent."""
    if model_type not in FAMILIES:
        raise HookmechError(f"{where}: model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
    name = f"{__name__}.{FAMILIES[model_type]}"
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name != name:
            raise
        raise HookmechError(f"{where}: model_type {model_type!r}: this hookmech has no {name} yet") from None


def compute_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """Return the torch dtype `dtype` names (`DTYPES`; None: float32); a UsageError otherwise."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise UsageError(f"dtype {dtype}: expected one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise UsageError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def from_pretrained(
    path_or_name: str | Path, *, dtype: str | torch.dtype | None = None, device: str = "cpu"
) -> HookedLM:
    """Return the `HookedLM` of a Hugging Face model folder (or hub name, `local_folder`), in
    eval mode on `device`, computing in `dtype` (float32 by default, whatever the stored weights'
    dtype: float16 and bfloat16 weights are widened exactly).

    The config records the compute dtype and the folder's ``model_type`` (``extra``); neither
    records the folder's path, so the same weights anywhere have one `model_hash`. A
    HookmechError names the file at fault: ``config.json`` (missing, not JSON, a model_type or
    option hookmech does not load) or the weights file (missing, unreadable, or not what the
    config describes: names missing or left over, other shapes)."""
    from ..model import HookedLM
    from ..sizes import check_fits

    check_device(device)
    torch_dtype = compute_dtype(dtype)
    folder = read_folder(local_folder(path_or_name))
    config_path = folder.path / CONFIG_FILE
    module = family(folder.model_type, config_path)
    try:
        cfg = module.model_config(folder.config)
    except HookmechError as error:
        raise HookmechError(f"{config_path}: {error}") from None
    dtype_name = next(name for name, value in DTYPES.items() if value == torch_dtype)
    cfg = dataclasses.replace(cfg, dtype=dtype_name, extra={**cfg.extra, "hf_model_type": folder.model_type})
    try:
        check_fits(cfg, "cpu", copies=2)
    except HookmechError as error:
        raise HookmechError(f"{config_path}: {error}") from None
    state = _converted_state(module, folder)
    model = _unfilled_model(HookedLM, cfg)
    _load_strict(model, state, folder.weights_file)
    tokenizer = tokenizer_file(folder.path)
    if tokenizer is not None:  # to_tokens / to_string: the tokenizer beside the weights, loaded on first use
        model.set_vocabulary(tokenizer)
    return model.to(device=device, dtype=torch_dtype).eval()


def _unfilled_model(model_class: type[HookedLM], cfg: ModelConfig) -> HookedLM:
    """Return ``model_class(cfg)`` on the CPU with its weights left undrawn: built on the meta
    device, as every weight is about to be replaced by the folder's. Drawing them would cost
    seconds at pretrained size (6 s for Mamba-130m's shape) and move torch's global generator.
    A model holding a buffer that no state dict carries (computed in its constructor) is built
    the ordinary way, as loading would leave that buffer empty."""
    with torch.device("meta"):
        model = model_class(cfg)
    if set(dict(model.named_buffers())) - set(model.state_dict()):
        return model_class(cfg)
    # to_empty makes new Parameters: the flags a mixer set on its own (Mamba's _no_weight_decay) go on them
    flags = {name: dict(vars(parameter)) for name, parameter in model.named_parameters()}
    model = model.to_empty(device="cpu")
    for name, parameter in model.named_parameters():
        vars(parameter).update(flags[name])
    return model


def _converted_state(module: ModuleType, folder: PretrainedFolder) -> dict[str, torch.Tensor]:
    """The folder's weights in hookmech's names, as float32 (the model's own dtype until it is
    moved to the compute dtype); a mismatch names the weights file."""
    try:
        state = module.convert_weights(folder.config, folder.weights())
    except WeightsMismatch as error:
        raise HookmechError(f"{folder.weights_file}: {error}") from None
    return {name: tensor.to(torch.float32) for name, tensor in state.items()}


def _load_strict(model: HookedLM, state: dict[str, torch.Tensor], weights_file: Path) -> None:
    """Load `state` into `model`, every name and shape as the model has it; else a HookmechError
    naming `weights_file` and the first disagreements."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise HookmechError(
            f"{weights_file}: weights do not match config.json (hookmech names missing {missing[:3]}, "
            f"unexpected {extra[:3]})"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise HookmechError(
                f"{weights_file}: weights do not match config.json: {name} has shape {tuple(tensor.shape)}, "
                f"config.json gives {tuple(expected[name].shape)}"
            )
    model.load_state_dict(state)


def local_folder(path_or_name: str | Path) -> Path:
    """Return the local folder of `path_or_name`: itself when it exists; else, for a hub name
    (``owner/name``), its snapshot in the Hugging Face cache, downloaded by huggingface_hub where
    a network exists (config, safetensors weights, tokenizer). A HookmechError in one line when
    it is neither (offline: it says so)."""
    path = Path(path_or_name)
    if path.exists():
        if not path.is_dir():
            raise HookmechError(f"{path}: not a model folder (a hookmech checkpoint file loads with hookmech.load)")
        return path
    name = str(path_or_name)
    if not _REPO_ID.match(name):
        raise HookmechError(f"{path}: no such model folder")
    return _hub_snapshot(name)


def is_hub_name(path_or_name: str | Path) -> bool:
    """Return True when `path_or_name` names no local file or folder and reads as a hub
    repository, ``owner/name`` (one slash, no file ending such as ``.safetensors``): what
    `hookmech.checkpoint.load` hands to `from_pretrained` rather than calling a missing file."""
    name = str(path_or_name)
    return (
        not Path(name).exists()
        and name.count("/") == 1
        and _REPO_ID.match(name) is not None
        and not name.endswith(_FILE_SUFFIXES)
    )


def is_pretrained(path_or_name: str | Path) -> bool:
    """Return True when `path_or_name` is a folder (a Hugging Face model folder, checked when
    read) or a hub name (`is_hub_name`), not a hookmech checkpoint file."""
    return Path(path_or_name).is_dir() or is_hub_name(path_or_name)


def _hub_snapshot(repo_id: str) -> Path:
    """The local snapshot of hub repository `repo_id` (huggingface_hub's download and cache)."""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError:
        raise HookmechError(
            f"{repo_id}: no such folder; a hub name is downloaded through huggingface_hub (pip install 'hookmech[hf]')"
        ) from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        raise HookmechError(
            f"{repo_id}: no such folder, and not in the Hugging Face cache; offline ({why}), it cannot be "
            "downloaded: download it where a network exists, or give a local folder"
        ) from None
    except RepositoryNotFoundError:
        raise HookmechError(f"{repo_id}: no such folder, and no such repository on the Hugging Face hub") from None
    except HfHubHTTPError as error:
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise HookmechError(f"{repo_id}: download from the Hugging Face hub failed ({first_line})") from None
