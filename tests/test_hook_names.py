"""The hook-name scheme has one owner, `hookmech.hook_names`: its builders and parser agree with
every hook of every mixer's model, and no other module of hookmech or of its CLI builds a hook
name by hand or takes one apart (an AST scan of the source, checked on the shapes it must and
must not flag)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import hookmech
from hookmech import hook_names, sites
from hookmech.hook_names import (
    BLOCK_PARTS,
    EMBED,
    FINAL_NORM,
    MIXER,
    POS_EMBED,
    HookName,
    block_aliases,
    block_hook,
    block_path,
    final_norm_hook,
    hook_attribute,
    inside_name,
    is_hook_name,
    layer_of,
    mixer_hook,
    needs_mlp,
    parse_hook,
    sublayer_hook,
    sublayer_of,
)
from hookmech.mixers import REGISTRY

from helpers import make_model

REPO = Path(hookmech.__file__).resolve().parent.parent
OWNER = REPO / "hookmech" / "hook_names.py"
SCANNED = ("hookmech", "cli")


# -- the scheme ----------------------------------------------------------------------------
@pytest.mark.parametrize("name,parsed", [
    ("blocks.1.hook_resid_pre", HookName(1, "resid_pre", None)),
    ("blocks.12.hook_mlp_out", HookName(12, "mlp_out", None)),
    ("blocks.0.mixer.hook_ssm_state", HookName(0, "mixer", "ssm_state")),
    ("blocks.0.hook_attn_out", HookName(0, "attn_out", None)),
    ("hook_embed", HookName(None, "embed", None)),
    ("ln_final.hook_normalized", HookName(None, "ln_final", "normalized")),
])
def test_parse_hook_reads_layer_part_and_inside_name(name, parsed):
    assert parse_hook(name) == parsed


@pytest.mark.parametrize("name", ["L1.block_in", "blocks.01.hook_resid_pre", "blocks.x.hook_q", "blocks.hook_q",
                                  "blocks.1.mixer.q", "blocks.1.mixer.sub.hook_q", "embed", ""])
def test_parse_hook_refuses_what_is_not_a_hook_name(name):
    assert parse_hook(name) is None


def test_builders_write_transformer_lens_names():
    assert block_hook(1, "resid_pre") == "blocks.1.hook_resid_pre"
    assert mixer_hook(0, "q") == "blocks.0.mixer.hook_q"
    assert block_path(0, "mixer.out_proj.weight") == "blocks.0.mixer.out_proj.weight"
    assert (hook_attribute("q"), inside_name("hook_q")) == ("hook_q", "q")
    assert block_aliases(2, {"hook_attn_out": "hook_mixer_out"}) == {"blocks.2.hook_attn_out": "blocks.2.hook_mixer_out"}
    assert block_aliases(0, {"attn.hook_z": "mixer.hook_y"}) == {"blocks.0.attn.hook_z": "blocks.0.mixer.hook_y"}
    assert sublayer_hook(1, "attn", "result") == "blocks.1.attn.hook_result"
    assert final_norm_hook("scale") == "ln_final.hook_scale" and final_norm_hook("normalized") == FINAL_NORM
    assert [needs_mlp(parse_hook(name)) for name in ("blocks.0.hook_resid_mid", "blocks.0.mlp.hook_post",
                                                   "blocks.0.ln2.hook_scale", "blocks.0.ln1.hook_scale")] == [True] * 3 + [False]
    assert layer_of("blocks.3.mixer.out_proj.weight") == 3 and layer_of(FINAL_NORM) is None
    assert is_hook_name("blocks.1.hook_q") and is_hook_name(EMBED) and not is_hook_name("L1.block_in")
    assert [sublayer_of(part) for part in BLOCK_PARTS] == [None, "mixer", "mixer", None, "mlp", "mlp", None]


@pytest.mark.parametrize("mixer", sorted(REGISTRY))
def test_every_hook_of_every_mixer_round_trips(ar_task, mixer):
    """Each hook the model has is one the scheme builds back from its parsed parts, and the site
    grammar (which asks the scheme) maps it to a site and back."""
    model = make_model(ar_task, mixers=mixer, pos_emb="learned")
    names = [*model.hook_dict, *model.hook_aliases]
    assert {EMBED, POS_EMBED, FINAL_NORM} <= set(names)
    for name in names:
        parsed = parse_hook(name)
        assert parsed is not None, name
        if parsed.layer is None:
            continue
        rebuilt = block_hook(parsed.layer, parsed.part) if parsed.inside is None else (
            mixer_hook(parsed.layer, parsed.inside) if parsed.part == MIXER else
            sublayer_hook(parsed.layer, parsed.part, parsed.inside))  # TransformerLens's attn.hook_z
        assert rebuilt == name
        assert model.layer_of_hook(name) == parsed.layer
    for name in model.hook_dict:
        assert sites.site_to_hook(sites.hook_to_site(name)) == name


# -- no hook name by hand outside the owner ----------------------------------------------------
#: a formatted value inside an f-string's text, as the scan renders it
HOLE = "\x00"
#: f-string text that builds a hook name: ``blocks.{l}``, ``hook_{name}``, ``{prefix}.hook_x``
BUILT_IN_FSTRING = re.compile(rf"blocks\.{HOLE}|(?<![A-Za-z0-9])hook_{HOLE}|{HOLE}\.?(?:mixer\.)?hook_\w")
#: a literal concatenated to a computed string that makes it a hook name
CONCATENATED = re.compile(r"(?:^|\.)blocks\.$|(?:^|\.)hook_$|^\.?(?:mixer\.)?hook_\w|^blocks\.")
#: %- or str.format-templates of hook names
TEMPLATE = re.compile(r"blocks\.(?:%|\{)|hook_(?:%|\{)")
#: a full hook name written out (a block's, the final norm's, an embedding's)
LITERAL_NAME = re.compile(r"blocks\.\d+\.\w[\w.]*|ln_final\.hook_\w+|hook_(?:pos_)?embed")
#: a hook point's attribute or a path to one inside a block, written out (``"hook_q"``,
#: ``"mixer.hook_ssm_out"``, ``"attn.hook_z"``): the mixer API names inside hooks by their short
#: name (``"q"``) and hookmech.hook_names builds the rest
ATTRIBUTE_LITERAL = re.compile(r"(?:\w+\.)?hook_(?!aliases$|to_site$)\w+")
#: a variable holding one hook name (a letter of it read by index is a hook name taken apart)
ONE_HOOK = re.compile(r"(?:\w+_)?hook(?:_name)?")
#: what a prefix, suffix or split literal of a hook name contains
NAME_PIECE = re.compile(r"blocks|hook_|mixer\.")
#: receivers whose name says they hold hook names (a "." split of anything else, a file name, is left alone)
HOOKISH = re.compile(r"hook|sender|receiver", re.IGNORECASE)
SPLITS = {"split", "rsplit", "partition", "rpartition"}
AFFIXES = {"startswith", "endswith", "removeprefix", "removesuffix"}


def _text(node: ast.AST) -> str | None:
    """The text of a string literal or f-string (formatted values as HOLE), None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else HOLE for part in node.values)
    return None


def _literals(node: ast.AST) -> list[str]:
    """The texts of `node` when it is a string literal, an f-string or a tuple of them."""
    items = node.elts if isinstance(node, ast.Tuple) else [node]
    return [text for item in items if (text := _text(item)) is not None]


def hand_built_hook_names(source: str) -> list[tuple[int, str]]:
    """Return ``(line, what)`` for each place `source` builds a hook name by hand (an f-string,
    a concatenation or a template giving ``blocks.{l}.`` or ``hook_{name}``, a full name written
    out) or takes one apart (a ``"."`` split of a hook name, a split, prefix or suffix test on
    ``blocks``/``hook_``/``mixer.``, a slice by ``len("hook_")``)."""
    tree = ast.parse(source)
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    in_fstrings = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.JoinedStr) and BUILT_IN_FSTRING.search(_text(node) or ""):
            found.append((line, "f-string builds a hook name"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings | in_fstrings:
            if LITERAL_NAME.fullmatch(node.value):
                found.append((line, f"hook name {node.value!r} written out"))
            elif ATTRIBUTE_LITERAL.fullmatch(node.value):
                found.append((line, f"hook attribute or path {node.value!r} written out"))
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and ONE_HOOK.fullmatch(node.value.id):
            if isinstance(node.slice, (ast.Constant, ast.UnaryOp, ast.Slice)):
                found.append((line, f"{node.value.id}[...] reads letters of a hook name"))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            texts = [text for side in (node.left, node.right) if (text := _text(side)) is not None]
            if len(texts) < 2 and any(CONCATENATED.search(text) for text in texts):
                found.append((line, "concatenation builds a hook name"))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            if TEMPLATE.search(_text(node.left) or ""):
                found.append((line, "%-template of a hook name"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, receiver = node.func.attr, ast.unparse(node.func.value)
            pieces = [text for arg in node.args for text in _literals(arg)]
            if method == "format" and TEMPLATE.search(_text(node.func.value) or ""):
                found.append((line, "str.format template of a hook name"))
            elif method in SPLITS | AFFIXES and any(NAME_PIECE.search(piece) for piece in pieces):
                found.append((line, f".{method}() takes a hook name apart"))
            elif method in SPLITS and "." in pieces and HOOKISH.search(receiver):
                found.append((line, f"{receiver}.{method}('.') takes a hook name apart"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len":
            if any("hook_" in piece for arg in node.args for piece in _literals(arg)):
                found.append((line, 'len("hook_") slices a hook name'))
    return sorted(found)


def test_no_module_but_the_owner_builds_or_parses_hook_names():
    offenders = [
        f"{path.relative_to(REPO)}:{line}: {what}"
        for folder in SCANNED
        for path in sorted((REPO / folder).rglob("*.py"))
        if path != OWNER
        for line, what in hand_built_hook_names(path.read_text())
    ]
    assert offenders == [], "ask hookmech.hook_names instead:\n" + "\n".join(offenders)


@pytest.mark.parametrize("snippet", [
    'name = f"blocks.{layer}.hook_resid_pre"',
    'name = f"blocks.{layer}.{part}"',
    'name = f"blocks.{layer}.mixer.hook_{inside}"',
    'point = getattr(self, f"hook_{c}")',
    'name = f"{prefix}hook_q"',
    'name = f"{prefix}.hook_mixer_in"',
    'name = "blocks." + str(layer) + ".hook_resid_pre"',
    'name = prefix + ".hook_q"',
    'name = "hook_" + inside',
    'name = "blocks.%d.hook_resid_pre" % layer',
    'name = "blocks.{}.hook_q".format(layer)',
    'final = "ln_final.hook_normalized"',
    'first = "blocks.0.hook_resid_pre"',
    'layer = int(hook.split(".")[1])',
    'parts = hook_name.split(".", 2)',
    'last = sender.split(".")[-1]',
    'inside = ends.receiver.rsplit(".hook_", 1)[1]',
    'inside = name.removeprefix("mixer.hook_")',
    'inside = hook_name.removeprefix(f"blocks.{layer}.mixer.")',
    'block = name.startswith("blocks.")',
    'scores = hook.endswith("hook_attn_scores")',
    'known = site.startswith(("blocks.", "hook_", "ln_final."))',
    'inside = hook[len("hook_"):]',
    'exact = hook in (None, "hook_q", "hook_k")',
    'aliases = {"hook_attn_out": "hook_mixer_out"}',
    'aliases = {"mixer.hook_ssm_out": "hook_mixer_out"}',
    'new[hook[-1]] = patched',
    'letter = hook_name[5:]',
])
def test_the_scan_flags_each_way_of_building_or_parsing_a_hook_name(snippet):
    assert hand_built_hook_names(snippet), snippet


@pytest.mark.parametrize("snippet", [
    'def f():\n    """Reads blocks.{l}.hook_resid_pre (``blocks.1.mixer.hook_q``)."""',
    'site = f"L{layer}.mixer.{name}"',
    'message = f"block {layer} has no hook {hook!r}"',
    'message = f"{hook_to_site(hook)} has no position axis"',
    'stem = name.rsplit(".", 1)[0]',
    'stem, _, suffix = entry.name.rpartition(".")',
    'major = version.split(".")[0]',
    'plain = address.removeprefix("ray://")',
    'dtype = str(tensor.dtype).removeprefix("torch.")',
    'path = f"acts/{which}/{hook}"',
    'exact = hook in (None, "q", "k")',
    'aliases = tl_attention_aliases(q="q", z="y")',
    'name = block_hook(layer, "resid_pre")',
    'last = hooks[-1]',
    'roles = key.startswith("roles/")',
])
def test_the_scan_leaves_unrelated_strings_alone(snippet):
    assert hand_built_hook_names(snippet) == [], snippet


def test_the_site_grammar_does_not_re_export_the_scheme():
    """The hook-name API is imported from hookmech.hook_names only (sites.py re-exported it until 0.x)."""
    for name in ("block_hook", "mixer_hook", "parse_hook", "HookName", "block_aliases", "BLOCK_PARTS"):
        assert name in hook_names.__dict__ and name not in sites.__all__
