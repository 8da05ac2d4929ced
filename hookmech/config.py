"""The model configuration: a frozen, JSON-serialisable dataclass that rebuilds a model."""

from __future__ import annotations

import contextvars
import dataclasses
import json
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import schema
from .errors import UsageError, unknown

# .mixers is imported where used: it loads torch, which a config does not need

if TYPE_CHECKING:
    from .mixers.mixer_spec import MixerSpec

NORMS = ("layernorm", "rmsnorm")
POS_EMBS = ("learned", "none")
#: how a model's weights are drawn (`ModelConfig.init`): "normal" is GPT-2's (every Linear and
#: embedding N(0, 0.02), every declared output projection N(0, 0.02/sqrt(2 n_layers)));
#: "mamba" is mamba-ssm's `_init_weights`, which zoology uses for Mamba blocks (Linear weights keep
#: PyTorch's default, biases zeroed, embeddings N(0, 0.02), out_proj Kaiming-uniform / sqrt(n_layers));
#: "normal-by-name" is zoology's own `_init_weights` for the other blocks, which finds the output
#: projections to scale by parameter name (``out_proj``, ``fc2``): "normal" except that a mixer whose
#: reference names its projection otherwise (`MixerSpec.reference_scales_output`: Based's ``proj_o``)
#: keeps N(0, 0.02) there
INITS = ("normal", "mamba", "normal-by-name")
#: what `build_config(init=...)` also takes: "zoology" picks what the paper's code (zoology's
#: `_init_weights`, by block type) draws for these mixers, and is resolved to one of INITS
INIT_CHOICES = (*INITS, "zoology")
#: the MLP's nonlinearity (`ModelConfig.mlp_act`): "gelu" is the exact GELU (zoology's, Pythia's);
#: "gelu_tanh" its tanh approximation (GPT-2's ``gelu_new``)
MLP_ACTS = ("gelu", "gelu_tanh")
#: fields added after the first release, with the values every earlier config meant: `to_json`
#: leaves a field out at that value, so that configs written before it existed keep their JSON
#: and their model_hash
LATER_FIELD_DEFAULTS: dict[str, Any] = {
    "init": "normal",
    "mlp_act": "gelu",
    "norm_eps": 1e-5,
    "parallel_residual": False,
}
#: the option by which long-convolution mixers learn the longest sequence (zoology's l_max);
#: the paper's code sets it to the task's context size
CONTEXT_OPTION = "l_max"


#: the precisions a model computes in (`ModelConfig.dtype`): hookmech builds and trains in float32;
#: a pretrained model loaded with ``from_pretrained(dtype=...)`` computes in float16 or bfloat16, and
#: `hookmech.load` casts a checkpoint to the dtype its config records
DTYPES = ("float32", "float16", "bfloat16")
#: set while a stored config is parsed without importing its plug-in mixers (`ModelConfig.from_json`)
_UNRESOLVED: contextvars.ContextVar[bool] = contextvars.ContextVar("unresolved_plug_ins", default=False)

#: the fields that size a model (integers >= 1)
SIZE_FIELDS = ("d_vocab", "n_ctx", "d_model", "n_layers", "mlp_hidden_mult")
#: the fields with one entry per layer
PER_LAYER_FIELDS = ("mixers", "mixer_kwargs", "mlp", "norms")


def check_config_values(values: dict[str, Any]) -> None:
    """Raise a UsageError naming the field, its value and what it should be when a model config's
    `values` (fields by name; absent ones are skipped) have the wrong type or size, name an
    unknown mixer or give a mixer an option it does not take or of the wrong type; return None.
    A config read from a file may hold anything JSON can, so types are checked before use.
    While a stored config is parsed unresolved (`ModelConfig.from_json`), a plug-in mixer's
    options are left unchecked: checking them would import it."""
    from .mixers import SPECS, check_mixer_options, mixer_class

    for name in SIZE_FIELDS:
        if name in values:
            _expect(name, values[name], schema.COUNT.fits(values[name]), schema.COUNT.describe())
    n_layers = values.get("n_layers")
    for name in (name for name in PER_LAYER_FIELDS if name in values):
        value = values[name]
        _expect(
            name, value, isinstance(value, (tuple, list)) and len(value) == n_layers, f"a list of {n_layers} entries"
        )
    if "tie_embeddings" in values:
        _expect("tie_embeddings", values["tie_embeddings"], isinstance(values["tie_embeddings"], bool), "true or false")
    if "mlp" in values:
        _expect("mlp", values["mlp"], all(isinstance(v, bool) for v in values["mlp"]), "true or false for each layer")
    if "extra" in values:
        _expect("extra", values["extra"], isinstance(values["extra"], dict), "a table")
    if "parallel_residual" in values:
        value = values["parallel_residual"]
        _expect("parallel_residual", value, isinstance(value, bool), "true or false")
    if "norm_eps" in values:
        value = values["norm_eps"]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1
        _expect("norm_eps", value, ok, "a number in (0, 1)")
    if "dtype" in values:
        _expect("dtype", values["dtype"], values["dtype"] in DTYPES, f"one of {', '.join(DTYPES)}")
    mixers, options = values.get("mixers", ()), values.get("mixer_kwargs", ())
    _expect("mixers", mixers, all(isinstance(name, str) for name in mixers), f"a list of {n_layers} names")
    _expect("mixer_kwargs", options, all(isinstance(o, dict) for o in options), "a table of options per layer")
    for name, layer_options in zip(mixers, options, strict=False):
        if name not in SPECS and _UNRESOLVED.get():
            continue
        check_mixer_options(name, mixer_class(name), layer_options)


def _expect(name: str, value: Any, ok: bool, expected: str) -> None:
    """Raise ``UsageError("NAME = VALUE: expected EXPECTED")`` unless `ok`."""
    if not ok:
        shown = list(value) if isinstance(value, tuple) else value
        raise UsageError(f"{name} = {schema.toml_text(shown)}: expected {expected}")


class NoModelError(UsageError, AttributeError):
    """`ModelConfig.device` of a config that no model holds. Also an AttributeError, so that
    ``getattr(cfg, "device", None)`` and ``hasattr`` see no device."""


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to rebuild a `HookedLM` (TransformerLens names where they exist).

    Per-layer fields (`mixers`, `mixer_kwargs`, `mlp`, `norms`) have `n_layers` entries.

    Besides its fields it answers what TransformerLens's generic code reads of a ``cfg``
    (``transformer_lens.patching``: `n_layers`, `n_heads`, `device`; its ``ActivationCache``:
    `normalization_type`, `final_rms`, `attn_only`, `d_mlp`, `n_key_value_heads`), as derived,
    read-only values that are never serialised (`to_json`), compared (``==``) or hashed: `n_heads`
    and `d_head` (layer 0's mixer's, `head_shape`), the others from the fields and, for the
    config a model holds (``model.cfg``), `device`.
    """

    d_vocab: int
    n_ctx: int
    d_model: int
    n_layers: int
    mixers: tuple[str, ...]
    mixer_kwargs: tuple[dict[str, Any], ...]
    mlp: tuple[bool, ...]
    norms: tuple[str, ...]
    pos_emb: str = "none"
    tie_embeddings: bool = True
    mlp_hidden_mult: int = 4
    final_norm: str = "layernorm"
    dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict)
    #: how the weights were drawn (INITS); left out of `to_json` when "normal", so configs written
    #: before the field existed keep their JSON and their model_hash
    init: str = "normal"
    #: the MLP's nonlinearity (MLP_ACTS); as the next two, left out of `to_json` at its default
    #: (`LATER_FIELD_DEFAULTS`)
    mlp_act: str = "gelu"
    #: every norm's epsilon (LayerNorm: added to the variance; RMSNorm: to the mean square)
    norm_eps: float = 1e-5
    #: blocks with an MLP compute ``r + mixer(ln1(r)) + mlp(ln2(r))`` (GPT-J, GPT-NeoX / Pythia):
    #: both sublayers read the block's input, and the block has no ``hook_resid_mid``
    parallel_residual: bool = False

    def __post_init__(self) -> None:
        from .mixers import canonical_name

        check_config_values(self.__dict__)
        # a mixer from outside the package is recorded by its canonical name, so that two spellings
        # of one class give one config (one model_hash); a registered name is its own (a stored
        # config parsed unresolved keeps its names: they are canonical when hookmech wrote them)
        if not _UNRESOLVED.get():
            object.__setattr__(self, "mixers", tuple(canonical_name(name) for name in self.mixers))
        for norm in (*self.norms, self.final_norm):
            if norm not in NORMS:
                raise unknown("norm", norm, NORMS)
        if self.pos_emb not in POS_EMBS:
            raise unknown("position embedding", self.pos_emb, POS_EMBS)
        if self.init not in INITS:
            raise unknown("init", self.init, INITS)
        if self.mlp_act not in MLP_ACTS:
            raise unknown("MLP activation", self.mlp_act, MLP_ACTS)

    # -- derived values (TransformerLens's names), not fields ------------------------------
    def head_shape(self, layer: int = 0) -> tuple[int, int]:
        """Return ``(n_heads, d_head)`` of block `layer`'s mixer as its spec states them
        (`MixerSpec.heads`): the size of the ``head`` axis of its per-head hooks and the width
        of one head there. A mixer without heads (mamba, baseconv, hyena) has one head of
        width d_model. n_heads * d_head is d_model except for mamba2 (its heads split d_inner)."""
        from .mixers import spec_of

        if not 0 <= layer < self.n_layers:
            raise UsageError(f"layer must be in 0..{self.n_layers - 1}, got {layer}")
        return spec_of(self.mixers[layer]).head_shape(self.d_model, self.mixer_kwargs[layer])

    @property
    def n_heads(self) -> int:
        """Heads of layer 0's mixer (`head_shape`; in a mixed model such as the `based` preset,
        which alternates baseconv and based, layer 0's: ``head_shape(layer)`` gives the others')."""
        return self.head_shape(0)[0]

    @property
    def d_head(self) -> int:
        """Width of one head of layer 0's mixer (`head_shape`)."""
        return self.head_shape(0)[1]

    @property
    def normalization_type(self) -> str:
        """TransformerLens's name of the final norm, "LN" (layernorm) or "RMS" (rmsnorm): the norm
        its ``apply_ln_to_stack`` applies (at a block, only a block norm of the same kind: a
        Mamba block's RMSNorm under a final LayerNorm is refused, `HookedLM.derived_activation`)."""
        return "LN" if self.final_norm == "layernorm" else "RMS"

    @property
    def final_rms(self) -> bool:
        """Whether the final norm is an RMSNorm (TransformerLens's flag)."""
        return self.final_norm == "rmsnorm"

    @property
    def attn_only(self) -> bool:
        """True when no block has an MLP (Mamba, Mamba-2): TransformerLens's decompositions then
        stack the mixers' outputs only."""
        return not any(self.mlp)

    @property
    def d_mlp(self) -> int:
        """The width of an MLP's hidden layer, mlp_hidden_mult * d_model; also where the blocks
        have none (`attn_only`), so that TransformerLens's neuron functions reach a block and are
        refused there, in one line, rather than by an assertion on d_mlp."""
        return self.mlp_hidden_mult * self.d_model

    @property
    def n_key_value_heads(self) -> None:
        """None: keys and values have as many heads as queries (TransformerLens's convention)."""
        return None

    @property
    def device(self):
        """The ``torch.device`` of the parameters of the model holding this config
        (``model.cfg``), read at each access, so it follows ``model.to(...)``. A config that no
        model holds (built, or read from JSON) has none: `NoModelError`."""
        model = self.holder()
        if model is None:
            raise NoModelError(
                "this ModelConfig belongs to no model, so it has no device; "
                "read model.cfg.device of a HookedLM built from it"
            )
        return next(model.parameters()).device

    def held_by(self, model) -> ModelConfig:
        """Return an equal config whose `device` is `model`'s (`HookedLM.cfg`; a weak reference,
        dropped when the config is pickled or copied)."""
        held = dataclasses.replace(self)
        object.__setattr__(held, "_model", weakref.ref(model))
        return held

    def holder(self):
        """Return the model holding this config (`held_by`), or None."""
        ref = self.__dict__.get("_model")
        return None if ref is None else ref()

    def __getstate__(self) -> dict[str, Any]:
        # pickling or copying keeps the fields only: a copy is held by no model until one takes it
        return {key: value for key, value in self.__dict__.items() if key != "_model"}

    def to_json(self) -> str:
        """Return the config as a JSON string (the checkpoint's `hookmech_config`)."""
        fields = dataclasses.asdict(self)
        for name, default in LATER_FIELD_DEFAULTS.items():
            if fields[name] == default and type(fields[name]) is type(default):
                del fields[name]
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, resolve_mixers: bool = True) -> ModelConfig:
        """Rebuild a config from `to_json` output; unknown keys are an error.

        With `resolve_mixers` False (a stored config read from a file), a plug-in mixer is not
        imported: its name is kept as stored and its options unchecked (a file named by a
        relative path is refused, `allow_list.check_stored_name`). Building a model of such a
        config imports it: `hookmech.load` first asks whether it is allowed."""
        from .mixers.allow_list import check_stored_name

        data = json.loads(text)
        if not isinstance(data, dict):
            raise UsageError(f"model config is not a JSON object: {schema.toml_text(data)[:80]}")
        known = {f.name for f in dataclasses.fields(cls)}
        extra_keys = set(data) - known
        if extra_keys:
            raise UsageError(f"model config has unknown keys: {', '.join(sorted(extra_keys))}")
        for name in PER_LAYER_FIELDS:
            if isinstance(data.get(name), list):
                data[name] = tuple(data[name])
        if resolve_mixers:
            check_config_values(data)  # before the constructor sees them: JSON may hold any type
            return cls(**data)
        token = _UNRESOLVED.set(True)
        try:
            check_config_values(data)
            for name in data.get("mixers", ()):
                check_stored_name(name)
            return cls(**data)
        finally:
            _UNRESOLVED.reset(token)


def build_config(
    *,
    d_vocab: int,
    n_ctx: int,
    mixers: str | list[str] = "attention",
    d_model: int = 64,
    n_layers: int = 2,
    layer_options: list[dict[str, Any]] | None = None,
    n_heads: int | None = None,
    mlp: bool | None = None,
    tie_embeddings: bool = True,
    pos_emb: str | None = None,
    mlp_hidden_mult: int = 4,
    init: str | None = None,
) -> ModelConfig:
    """Return a validated `ModelConfig`, filling defaults from what each mixer declares.

    `mixers` is one mixer name for every layer or a list with one per layer: a registry name, or
    a mixer of your own (``module:Class``, ``path/to/file.py:Class``, an entry point), recorded by
    its canonical name (`hookmech.mixers.canonical_name`);
    `layer_options` one kwargs dict per layer; `n_heads` goes to mixers that take a head
    count, and `n_ctx` becomes `l_max` of mixers that take one (unless set);
    `mlp`/`pos_emb` None mean "what the mixers declare"; `init` None means "normal", and
    "zoology" what the paper's code draws for these mixers (`resolve_init`).
    """
    from .mixers import canonical_name, check_mixer_options, mixer_options, spec_of

    if n_layers <= 0:
        raise UsageError(f"n_layers must be > 0, got {n_layers}")
    names = [mixers] * n_layers if isinstance(mixers, str) else list(mixers)
    if len(names) == 1 and n_layers > 1:
        names = names * n_layers
    if len(names) != n_layers:
        raise UsageError(f"got {len(names)} mixers for {n_layers} layers")
    layer_options = layer_options or [{} for _ in range(n_layers)]
    if len(layer_options) != n_layers:
        raise UsageError(f"got {len(layer_options)} sets of layer options for {n_layers} layers")
    specs = []
    kwargs_per_layer = []
    names = [canonical_name(name) for name in names]
    for name, options in zip(names, layer_options, strict=True):
        spec = spec_of(name)
        options = dict(options)
        head_option = spec.head_count_option()
        if n_heads is not None and head_option is not None and head_option not in options:
            options[head_option] = n_heads
        if CONTEXT_OPTION in mixer_options(spec.mixer) and CONTEXT_OPTION not in options:
            options[CONTEXT_OPTION] = n_ctx
        check_mixer_options(name, spec.mixer, options)
        specs.append(spec)
        kwargs_per_layer.append(options)
    if pos_emb is None:
        pos_emb = "learned" if any(s.default_pos_emb == "learned" for s in specs) else "none"
    return ModelConfig(
        d_vocab=d_vocab,
        n_ctx=n_ctx,
        d_model=d_model,
        n_layers=n_layers,
        mixers=tuple(names),
        mixer_kwargs=tuple(kwargs_per_layer),
        mlp=tuple(s.block_mlp if mlp is None else mlp for s in specs),
        norms=tuple(s.block_norm for s in specs),
        pos_emb=pos_emb,
        tie_embeddings=tie_embeddings,
        mlp_hidden_mult=mlp_hidden_mult,
        init=resolve_init(init, specs),
    )


def resolve_init(init: str | None, specs: list[MixerSpec]) -> str:
    """Return the `ModelConfig.init` (one of INITS) that `init` asks for in a model of the mixers
    of `specs`, one per layer. "zoology" follows zoology's `_init_weights`, which picks mamba-ssm's
    scheme when the model's block type is Mamba's: "mamba" when every layer's mixer declares it
    (`MixerSpec.reference_init`); else "normal-by-name" when a mixer's output projection escapes
    zoology's rescaling by name (`MixerSpec.reference_scales_output`), and "normal" when the two draw
    the same (so that a model whose draw did not change keeps its config, and its model_hash)."""
    if init is None:
        return "normal"
    if init not in INIT_CHOICES:
        raise unknown("init", init, INIT_CHOICES)
    if init != "zoology":
        return init
    if all(s.reference_init == "mamba" for s in specs):
        return "mamba"
    return "normal" if all(s.reference_scales_output for s in specs) else "normal-by-name"
