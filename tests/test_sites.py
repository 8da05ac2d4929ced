"""Site grammar and position specs (docs/guide.md §5)."""
from __future__ import annotations

import pytest
import torch

from hookmech.errors import UsageError
from hookmech.sites import hook_to_site, list_sites, position_patches, resolve_sites, site_to_hook


@pytest.mark.parametrize("site,hook", [
    ("L1.block_in", "blocks.1.hook_resid_pre"), ("L0.mixer_in", "blocks.0.hook_mixer_in"),
    ("L0.mixer_out", "blocks.0.hook_mixer_out"), ("L3.resid_mid", "blocks.3.hook_resid_mid"),
    ("L0.mlp_in", "blocks.0.hook_mlp_in"), ("L0.mlp_out", "blocks.0.hook_mlp_out"),
    ("L2.block_out", "blocks.2.hook_resid_post"), ("L1.mixer.q", "blocks.1.mixer.hook_q"),
    ("embed", "hook_embed"), ("pos_embed", "hook_pos_embed"), ("final_norm", "ln_final.hook_normalized"),
])
def test_site_and_hook_names_map_both_ways(site, hook):
    assert site_to_hook(site) == hook
    assert hook_to_site(hook) == site


def test_wildcards_expand_in_forward_order(ar_model):
    assert resolve_sites(["L*.block_in"], ar_model.hook_dict) == ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre"]
    layer1 = resolve_sites(["L1.*"], ar_model.hook_dict)
    assert layer1 == [f"blocks.1.hook_{h}" for h in ["resid_pre", "mixer_in", "mixer_out", "resid_mid", "mlp_in", "mlp_out", "resid_post"]]
    assert len(resolve_sites(["all"], ar_model.hook_dict)) == 14
    inside = resolve_sites(["L0.mixer.*"], ar_model.hook_dict)
    assert inside == [f"blocks.0.mixer.hook_{h}" for h in ["q", "k", "v", "attn_scores", "pattern", "z"]]
    # block-level wildcards never reach inside the mixer
    assert not any(".mixer." in hook for hook in resolve_sites(["all", "L1.*"], ar_model.hook_dict))


def test_hook_names_are_accepted_and_duplicates_collapse(ar_model):
    assert resolve_sites(["blocks.1.hook_resid_pre", "L1.block_in"], ar_model.hook_dict) == ["blocks.1.hook_resid_pre"]


@pytest.mark.parametrize("bad,expected", [("L1.blok_in", "L1.block_in"), ("L5.block_in", "L1.block_in"), ("L1.mixer.qq", "L1.mixer.q")])
def test_unknown_sites_suggest_close_matches(ar_model, bad, expected):
    with pytest.raises(UsageError, match=expected):
        resolve_sites([bad], ar_model.hook_dict)


def test_pattern_matching_nothing_is_an_error(ar_model):
    with pytest.raises(UsageError):
        resolve_sites(["L9.*"], ar_model.hook_dict)


def test_positions_roles_integers_joint_whole_and_all():
    roles = {"key": torch.tensor([1, 3]), "value": torch.tensor([2, 4])}
    lengths = torch.tensor([6, 5])
    patches = position_patches(["key", "-1", "2", "key+value", "whole"], roles, lengths, 6)
    as_lists = {p.label: p.mask.nonzero().tolist() for p in patches}
    assert as_lists["key"] == [[0, 1], [1, 3]]
    assert as_lists["-1"] == [[0, 5], [1, 4]]          # counts back from each row's length
    assert as_lists["2"] == [[0, 2], [1, 2]]
    assert as_lists["key+value"] == [[0, 1], [0, 2], [1, 3], [1, 4]]
    assert patches[-1].mask.sum(1).tolist() == [6, 5]  # padding is never patched
    every = position_patches(["all"], roles, lengths, 6)
    assert [p.label for p in every] == [str(i) for i in range(6)]
    assert every[5].mask.tolist() == [[False] * 5 + [True], [False] * 6]


@pytest.mark.parametrize("bad", ["kye", "7", "-8", "divider"])
def test_bad_positions_are_errors(bad):
    roles = {"key": torch.tensor([1]), "value": torch.tensor([2])}
    with pytest.raises(UsageError):
        position_patches([bad], roles, torch.tensor([6]), 6)


def test_list_sites_reports_every_hook_with_shape(ar_model):
    rows = list_sites(ar_model)
    assert len(rows) == len(ar_model.hook_dict)
    by_site = {r["site"]: r for r in rows}
    assert by_site["L1.block_in"]["shape"] == [1, ar_model.cfg.n_ctx, 32]
    assert by_site["L0.mixer.pattern"]["pos_axis"] == 2
    assert by_site["L0.mixer.pattern"]["axes"] == "batch head query_pos key_pos"


def _full_length_shapes(model) -> dict[str, list[int]]:
    """The reference: every hook's shape from one forward of n_ctx tokens (what `list_sites` ran before)."""
    tokens = torch.zeros(1, model.cfg.n_ctx, dtype=torch.long)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, return_cache_object=False)
    return {hook: list(value.shape) for hook, value in cache.items()}


@pytest.mark.parametrize("mixer", ["attention", "hyena", "h3", "mamba", "mamba2", "based", "rwkv"])
def test_list_sites_shapes_equal_a_full_length_forward(mixer):
    """Shapes measured on short sequences and extrapolated to n_ctx equal a forward of n_ctx tokens,
    position axes (an attention pattern's two) and long-convolution filter lags included."""
    import hookmech
    from hookmech.config import build_config

    torch.manual_seed(0)
    model = hookmech.HookedLM(build_config(d_vocab=20, n_ctx=37, d_model=16, n_layers=1, mixers=[mixer])).eval()
    reference = _full_length_shapes(model)
    assert {row["hook"]: row["shape"] for row in list_sites(model)} == {hook: reference.get(hook) for hook in model.hook_dict}


def test_list_sites_never_runs_the_full_context():
    """A pretrained-size context (Pythia's 2048) is not run: every forward `list_sites` makes is
    a few tokens long, and the shapes still say n_ctx."""
    import hookmech
    from hookmech.config import build_config

    model = hookmech.HookedLM(build_config(d_vocab=20, n_ctx=2048, d_model=16, n_layers=1)).eval()
    lengths = []
    model.hook_dict["hook_embed"].add_hook(lambda value, hook: lengths.append(value.shape[1]))
    rows = {row["site"]: row for row in list_sites(model)}
    model.reset_hooks()
    assert lengths and max(lengths) <= 4
    assert rows["L0.block_in"]["shape"] == [1, 2048, 16]
    assert rows["L0.mixer.pattern"]["shape"] == [1, 1, 2048, 2048]
