"""What an activation cache file must hold, and the checks that refuse one that does not
(docs/formats.md, "Activation cache"): its metadata when it is opened (`check_format`,
`check_version`, `json_attribute`, `check_layout`) and its row data as it is read (`check_row_integers`,
`check_probabilities`, `refuse_non_finite_acts`, `refuse_other_position_axis`). Each refusal is a
HookmechError naming the file, the dataset and the first bad value. `hookmech.cache.CacheFile`
reads a cache through these checks; whether a cache was made from a given model is its
`check_model`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch

from .config import ModelConfig
from .errors import HookmechError, UsageError
from .hook_names import parse_hook
from .validate import allows_minus_inf, first_non_finite, value_at

# .hooks, .model and .mixers.allow_list are imported where used: they load TransformerLens, which this module does not

FORMAT = "hookmech-cache"
FORMAT_VERSION = 1
#: the format attribute of dataset files (`hookmech.datasets`), told apart in messages
DATASET_FORMAT = "hookmech-dataset"
#: the dtypes the format allows (docs/formats.md): activations, p(answer), and the integer datasets
ACTIVATION_DTYPES = ("float32", "float16")
P_ANSWER_DTYPE = "float32"
INTEGER_DTYPE = "int32"
#: the integer datasets of the format, one value per row (``[N]``) or per token (``[N, T]``)
TOKEN_COLUMNS = ("tokens/clean", "tokens/corrupt")
ROW_COLUMNS = ("answers", "lengths", "doc_index")


# -- metadata, checked on opening ----------------------------------------------------------------
def check_format(h5: h5py.File, path: Path) -> None:
    """Raise a HookmechError unless the root attribute ``format`` is `FORMAT` (a dataset file is
    told apart). Returns None."""
    kind = h5.attrs.get("format")
    if kind == DATASET_FORMAT:
        raise HookmechError(
            f"{path}: a hookmech dataset file, not an activation cache (`train --data` and "
            "`patch --data` read it; `hookmech cache` makes caches)"
        )
    if kind != FORMAT:
        raise HookmechError(f"{path}: not a hookmech cache (format attribute {kind!r})")


def check_version(h5: h5py.File, path: Path) -> None:
    """Raise a HookmechError unless the root attribute ``format_version`` is the integer
    `FORMAT_VERSION`. Returns None."""
    version = h5.attrs.get("format_version")
    if version is None:
        raise HookmechError(f"{path}: no format_version attribute, expected the integer {FORMAT_VERSION}")
    if isinstance(version, (bool, np.bool_)) or not isinstance(version, (int, np.integer)):
        raise HookmechError(f"{path}: format_version is {version!r}, expected the integer {FORMAT_VERSION}")
    if int(version) != FORMAT_VERSION:
        raise HookmechError(f"{path}: cache format version {version} is not supported (expected {FORMAT_VERSION})")


def json_attribute(h5: h5py.File, path: Path, name: str, what: str) -> dict[str, Any]:
    """Return root attribute `name` parsed: a JSON object (`what` says what it holds); anything
    else is a HookmechError."""
    raw = h5.attrs.get(name)
    expected = f"expected {what} as a JSON object"
    if raw is None:
        raise HookmechError(f"{path}: no {name} attribute, {expected}")
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", "replace")
    if not isinstance(raw, str):
        raise HookmechError(f"{path}: the {name} attribute is {type(raw).__name__}, not text; {expected}")
    try:
        value = json.loads(raw)
    except ValueError as error:
        raise HookmechError(f"{path}: the {name} attribute is not JSON ({error}); {expected}") from None
    if not isinstance(value, dict):
        raise HookmechError(f"{path}: the {name} attribute is a JSON {type(value).__name__}; {expected}")
    return value


def _dataset(h5: h5py.File, path: Path, name: str) -> h5py.Dataset:
    """Return dataset `name`; a HookmechError if it is missing or a group."""
    item = h5.get(name)
    if item is None:
        raise HookmechError(f"{path}: cache has no {name} (truncated or not written by hookmech)")
    if not isinstance(item, h5py.Dataset):
        raise HookmechError(f"{path}: {name} is a group, expected a dataset (not written by hookmech)")
    return item


def _group(h5: h5py.File, path: Path, name: str, holds: str) -> h5py.Group | None:
    """Return group `name` (None if absent); a HookmechError if it is a dataset or holds a group."""
    item = h5.get(name)
    if isinstance(item, h5py.Dataset):
        raise HookmechError(f"{path}: {name} is a dataset, expected a group of {holds}")
    for key in item or ():
        if not isinstance(item[key], h5py.Dataset):
            raise HookmechError(f"{path}: {name}/{key} is a group, expected a dataset (not written by hookmech)")
    return item


def _check_dtype(h5: h5py.File, path: Path, name: str, allowed: Sequence[str], what: str) -> None:
    dtype = h5[name].dtype
    if dtype.name not in allowed:
        raise HookmechError(f"{path}: {name} is {dtype}; the format stores {what} as {' or '.join(allowed)}")


def check_layout(h5: h5py.File, path: Path) -> tuple[int, int]:
    """Return the cache's (N, T) after checking its layout: a HookmechError names the first
    dataset the format needs that is missing, of another kind or dtype, or whose rows disagree
    with the tokens' (a truncated or hand-made file). Reads metadata only."""
    for name in (*TOKEN_COLUMNS, *ROW_COLUMNS, "p_answer/clean", "p_answer/corrupt"):
        _dataset(h5, path, name)
    roles = _group(h5, path, "roles", "[N] datasets (one per role)")
    if roles is None:
        raise HookmechError(f"{path}: cache has no roles (truncated or not written by hookmech)")
    if "query" not in roles:
        raise HookmechError(
            f"{path}: roles has no query (the position each row's answer is read at; roles: "
            f"{', '.join(roles) or 'none'})"
        )
    acts = {
        which: _group(h5, path, f"acts/{which}", "[N, ...] datasets (one per hook)") for which in ("clean", "corrupt")
    }
    tokens = h5["tokens/clean"].shape
    if len(tokens) != 2 or h5["tokens/corrupt"].shape != tokens:
        raise HookmechError(
            f"{path}: cache tokens have shapes {list(tokens)} (clean) and "
            f"{list(h5['tokens/corrupt'].shape)} (corrupt); expected two [N, T] arrays"
        )
    if 0 in tokens:
        raise HookmechError(f"{path}: the cache holds no rows (tokens of shape {list(tokens)})")
    n_rows = tokens[0]
    role_columns = [f"roles/{role}" for role in roles]
    for name in (*ROW_COLUMNS, "p_answer/clean", "p_answer/corrupt", *role_columns):
        shape = h5[name].shape
        if shape != (n_rows,):
            raise HookmechError(
                f"{path}: {name} has {(shape or (0,))[0]} rows, the cache {n_rows} "
                f"(shape {list(shape)}, expected [{n_rows}]; truncated or not written by hookmech)"
            )
    for name in (*TOKEN_COLUMNS, *ROW_COLUMNS, *role_columns):
        _check_dtype(h5, path, name, (INTEGER_DTYPE,), "tokens, lengths, answers, document and role indices")
    for which in ("clean", "corrupt"):
        _check_dtype(h5, path, f"p_answer/{which}", (P_ANSWER_DTYPE,), "p(answer)")
        for hook in acts[which] or ():
            name = f"acts/{which}/{hook}"
            shape = h5[name].shape
            if len(shape) < 2 or shape[0] != n_rows:
                raise HookmechError(
                    f"{path}: {name} has shape {list(shape)}, expected "
                    f"{n_rows} rows like the tokens (truncated or not written by hookmech)"
                )
            _check_dtype(h5, path, name, ACTIVATION_DTYPES, "activations")
    return int(tokens[0]), int(tokens[1])


# -- row data, checked as it is read -------------------------------------------------------------
def check_row_integers(
    path: Path, columns: dict[str, np.ndarray], numbers: np.ndarray, model_config: dict[str, Any], n_pos: int
) -> None:
    """Raise a HookmechError naming the first value of `columns` (datasets' values at the file
    rows `numbers`) outside its range: token ids against the `model_config`'s d_vocab, lengths
    1..`n_pos`, documents >= 0, roles inside the row (the `lengths` column). Returns None."""
    d_vocab = model_config.get("d_vocab")
    if isinstance(d_vocab, int) and not isinstance(d_vocab, bool):
        vocab, high = f"a token id 0..{d_vocab - 1} (d_vocab {d_vocab} in the cache's model_config)", d_vocab
    else:
        vocab, high = "a token id >= 0", None
    ranges = {
        **{name: (0, high, vocab) for name in (*TOKEN_COLUMNS, "answers")},
        "lengths": (1, n_pos + 1, f"1..{n_pos} (the tokens' width)"),
        "doc_index": (0, None, "a document number >= 0"),
    }
    for name, (low, top, expected) in ranges.items():
        if name in columns:
            _refuse_outside(path, name, columns[name], numbers, low, top, expected)
    for name, positions in columns.items():
        if name.startswith("roles/"):
            lengths = columns["lengths"]
            outside = (positions < 0) | (positions >= lengths)
            if outside.any():
                row = int(np.argmax(outside))
                raise HookmechError(
                    f"{path}: {name} row {numbers[row]} holds {positions[row]}, outside the row "
                    f"(length {lengths[row]}: positions 0..{lengths[row] - 1})"
                )


def _refuse_outside(
    path: Path, name: str, values: np.ndarray, numbers: np.ndarray, low: int, high: int | None, expected: str
) -> None:
    outside = values < low
    if high is not None:
        outside |= values >= high
    if outside.any():
        index = np.unravel_index(int(np.argmax(outside)), values.shape)
        where = f", position {index[1]}," if values.ndim == 2 else ""
        raise HookmechError(f"{path}: {name} row {numbers[index[0]]}{where} holds {values[index]}, expected {expected}")


def check_probabilities(path: Path, name: str, values: np.ndarray, numbers: np.ndarray) -> None:
    """Raise a HookmechError naming the first of `values` (dataset `name` at the file rows
    `numbers`) that is not a probability in [0, 1] (NaN and infinities included). Returns None."""
    outside = ~((values >= 0) & (values <= 1))  # NaN compares False
    if outside.any():
        row = int(np.argmax(outside))
        raise HookmechError(f"{path}: {name} row {numbers[row]} holds {values[row]}, expected a probability in [0, 1]")


def refuse_non_finite_acts(
    path: Path, hook: str, which: str, values: np.ndarray, file_index: Callable[[tuple], list[int]]
) -> None:
    """Raise a HookmechError if `values` (read from acts/`which`/`hook`) hold a NaN or an
    infinity (-inf of masked attention scores aside); `file_index` maps an index of `values` to
    the dataset's. Returns None."""
    index = first_non_finite(values, allow_minus_inf=allows_minus_inf(hook))
    if index is not None:
        where = file_index(index)
        raise HookmechError(
            f"{path}: acts/{which}/{hook} holds {value_at(values, index)} at row {where[0]}, index {where} "
            "(the first non-finite value): the cache is damaged or its model's activations were not finite"
        )


def model_hook_points(model_config: dict[str, Any]) -> dict[str, Any]:
    """Return the hook points of the model `model_config` describes, built on the meta device
    (shapes only, no weights), or {} when no model builds from it or it names a plug-in mixer:
    reading a cache never imports code its config names."""
    from .mixers.allow_list import plug_ins
    from .model import HookedLM  # TransformerLens: only for hooks inside a sublayer

    mixers = model_config.get("mixers")
    if not isinstance(mixers, list) or plug_ins(map(str, mixers)):
        return {}
    with contextlib.suppress(HookmechError, TypeError, ValueError, KeyError), torch.device("meta"):
        return dict(HookedLM(ModelConfig.from_json(json.dumps(model_config))).hook_dict)
    return {}


def refuse_other_position_axis(hook: str, hook_points: Callable[[], dict[str, Any]]) -> None:
    """Raise a UsageError when `hook` stores positions elsewhere than axis 1 (attention's
    ``[N, head, q, k]`` scores and patterns): one position per row would read heads as
    positions. `hook_points` returns the model's hook points (`model_hook_points`); it is called
    only for hooks inside a sublayer (a block's own hooks and the embeddings are ``[N, pos, ...]``
    by the grammar). Returns None."""
    parsed = parse_hook(hook)
    if parsed is not None and parsed.inside is None:
        return
    from .hooks import axes_of, pos_axis_of  # TransformerLens: only for hooks inside a sublayer

    point = hook_points().get(hook)
    if point is not None and pos_axis_of(point) != 1:
        raise UsageError(
            f"{hook} is stored as [{axes_of(point).replace(' ', ', ')}]: one position per row reads axis 1, "
            "which is not its position axis there; read the dataset itself (cache[site]) and index its axes"
        )
