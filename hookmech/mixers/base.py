"""What every sequence mixer declares, so that the backbone never has to name one."""
from __future__ import annotations

import inspect
from typing import Any, ClassVar

from torch import nn

from ..errors import UsageError, suggest


class Mixer(nn.Module):
    """Base class of sequence mixers: ``[batch, pos, d_model] -> [batch, pos, d_model]``.

    Subclasses declare the block they expect (the backbone reads these, never the class
    name) and are built as ``REGISTRY[name](d_model=..., **kwargs)``.
    """

    #: norm of the block around this mixer: "layernorm" or "rmsnorm"
    block_norm: ClassVar[str] = "layernorm"
    #: whether the block has an MLP after the mixer by default
    block_mlp: ClassVar[bool] = True
    #: default position embedding of a model made of this mixer ("learned" or "none")
    default_pos_emb: ClassVar[str] = "none"


def mixer_options(cls: type) -> dict[str, Any]:
    """Return the keyword options of a mixer class (besides d_model) with their defaults."""
    params = inspect.signature(cls.__init__).parameters
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {
        name: (None if p.default is inspect.Parameter.empty else p.default)
        for name, p in params.items()
        if name not in ("self", "d_model") and p.kind in keyword_kinds
    }


def check_mixer_options(name: str, cls: type, kwargs: dict[str, Any]) -> None:
    """Raise a UsageError naming the mixer if `kwargs` holds an option `cls` does not take."""
    from ..options import check_option_types

    known = mixer_options(cls)
    for key in kwargs:
        if key not in known:
            raise UsageError(
                f"mixer {name!r} takes no option {key!r}{suggest(key, known)}"
                f"; its options: {', '.join(sorted(known)) or 'none'}"
            )
    check_option_types(f"mixer {name!r}", cls, kwargs)
