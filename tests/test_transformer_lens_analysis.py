"""TransformerLens's own analysis on every hookmech model (docs/guide.md, "TransformerLens's own
tools"): the ActivationCache's logit lens, decompositions, head results and logit attributions,
each checked against a direct computation from the model's weights and hooks, and
``transformer_lens.patching``'s sweeps checked against the patching engine, or refused in one
line where a block lacks the component (a Mamba block's MLP, a head hook of a mixer without one).

Tolerances (tests/helpers.py). The analyses run on float64 copies of the models, where a residual
stream and the sum of its parts (or a logit and the sum of its attributions) are one set of
float64 terms summed in two orders: FLOAT64_SUM_TOL. TL's patching sweeps run on float32 models
and are compared with the engine at ENGINE_TOL, the contract of tests/test_transformer_lens_compat.py.
"""
from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch
from transformer_lens import patching as tl_patching

import hookmech
from hookmech.config import build_config
from hookmech.errors import NoComponentError, UsageError
from hookmech.mixers import REGISTRY, SPECS
from hookmech.patching import patch
from hookmech.sites import resolve_sites

from helpers import ENGINE_TOL, FLOAT64_SUM_TOL, REPO, head_options, make_model, mixers_with_heads, unit_variance

FIXTURES = {name: REPO / "fixtures" / f"{name}.safetensors" for name in ("attention_ar_cpu", "mamba_ar_cpu")}
#: a Mamba model with MLP blocks and a final RMSNorm: TransformerLens's "RMS" normalisation throughout
RMS_FINAL = "mamba_mlp_rms_final"
ANALYSED = [*FIXTURES, *sorted(REGISTRY), RMS_FINAL]
#: options giving each mixer with heads (its spec's `heads`) several of them
HEAD_OPTIONS = {name: head_options(name) for name in mixers_with_heads()}


def tl_alias(name: str, tl_hook: str) -> str | None:
    """The inside hook (without "hook_") that TransformerLens's ``attn.{tl_hook}`` is an alias of in
    mixer `name` (`MixerSpec.tl_attention`), or None."""
    return SPECS[name].tl_attention.get(tl_hook.removeprefix("hook_"))


#: the inside hook TransformerLens's attn.hook_z is, per mixer with a per-head output
HEAD_OUTPUT = {name: tl_alias(name, "hook_z") for name in sorted(REGISTRY) if tl_alias(name, "hook_z")}
#: the mixers whose output projection's input splits by heads (h3 has heads but no hook of its output)
HEADED = {name for name, spec in SPECS.items() if spec.output_head_axes}
#: the inside hooks TransformerLens's attn.hook_q, hook_k, hook_v are, per mixer with them
QKV = {name: {tl: tl_alias(name, f"hook_{tl}") for tl in "qkv"} for name in sorted(REGISTRY)
       if all(tl_alias(name, f"hook_{tl}") for tl in "qkv")}
WITHOUT_MLP = sorted(name for name, spec in SPECS.items() if not spec.block_mlp)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """The same float64 terms summed in two orders (FLOAT64_SUM_TOL)."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=FLOAT64_SUM_TOL)


def randomise_norms(model: hookmech.HookedLM, seed: int = 2) -> None:
    """Draw every norm's weight around 1 and its bias around 0 (in place), so that the final norm's
    weight and bias take part in every check (a fresh model's are exactly 1 and 0)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            for name in ("weight", "bias"):
                param = getattr(module, name, None) if "Norm" in type(module).__name__ else None
                if param is not None:
                    param.copy_((name == "weight") + 0.5 * torch.randn(param.shape, generator=generator))


def analysed_model(name: str) -> tuple[hookmech.HookedLM, hookmech.tasks.Batch]:
    """(float64 model, batch): a bundled CPU fixture, or a random 2-layer model of mixer `name`
    (two heads where it has heads), or RMS_FINAL, with random norm weights."""
    if name in FIXTURES:
        path = FIXTURES[name]
        return hookmech.load(path).double().eval(), hookmech.tasks.from_checkpoint(path).sample(6, seed=3)
    task = hookmech.tasks.make("ar", vocab_size=16, num_kv_pairs=3)
    if name == RMS_FINAL:
        cfg = build_config(d_vocab=task.d_vocab, n_ctx=task.n_ctx, mixers="mamba", d_model=16, mlp=True)
        torch.manual_seed(0)
        model = hookmech.HookedLM(dataclasses.replace(cfg, final_norm="rmsnorm")).eval()
    else:
        options = HEAD_OPTIONS.get(name, {})
        model = make_model(task, mixers=name, d_model=16, layer_options=[options, options])
    randomise_norms(model)
    return model.double(), task.sample(6, seed=3)


@pytest.fixture(scope="module", params=ANALYSED)
def run(request):
    """One run of an analysed model: model, batch, logits, cache, rows/positions/answers indices."""
    model, batch = analysed_model(request.param)
    logits, cache = model.run_with_cache(batch.tokens)
    n_rows, n_pos = batch.tokens.shape
    return SimpleNamespace(name=request.param, model=model, batch=batch, logits=logits, cache=cache,
                           n=model.cfg.n_layers, rows=torch.arange(n_rows)[:, None], pos=torch.arange(n_pos),
                           answers=batch.answers)


def final_resid(run) -> torch.Tensor:
    return run.cache[f"blocks.{run.n - 1}.hook_resid_post"]


def logit_offset(model: hookmech.HookedLM, tokens: torch.Tensor) -> torch.Tensor:
    """What the logit of each token adds to its direction · normalised residual: the final norm's
    bias (a LayerNorm's) read by the unembedding, plus b_U."""
    bias = getattr(model.ln_final.norm, "bias", None)
    offset = model.b_U[tokens]
    return offset if bias is None else offset + bias @ model.W_U[:, tokens]


def answer_logits(run, tokens: torch.Tensor) -> torch.Tensor:
    """``[batch, pos]``: the logit of tokens[row] at every position of the row."""
    return run.logits[run.rows, run.pos, tokens[:, None]]


# -- the logit lens, decompositions and attributions ---------------------------------------
def test_logit_lens_of_the_final_accumulated_residual_is_the_models_logits(run):
    stack, labels = run.cache.accumulated_resid(apply_ln=True, return_labels=True)
    assert labels == [f"{layer}_pre" for layer in range(run.n)] + ["final_post"]
    close(stack[-1] @ run.model.W_U + run.model.b_U, run.logits)
    close(run.model.unembed(stack[-1]), run.logits)
    close(stack[-1], run.cache["ln_final.hook_normalized"])
    for layer in range(run.n):  # every earlier residual through the final norm, as a logit lens reads it
        close(stack[layer], run.model.ln_final.norm(run.cache[f"blocks.{layer}.hook_resid_pre"]))
    # TransformerLens's own logit lens: the same stack through the unembedding
    lens = run.cache.logit_lens(positions=None, return_type="logits")
    assert lens.labels == labels
    close(lens.readout.values, stack @ run.model.W_U + run.model.b_U)


def test_decompose_resid_stacks_the_sublayer_outputs_that_sum_to_the_residual(run):
    parts, labels = run.cache.decompose_resid(return_labels=True)
    expected = ["embed"] + ["pos_embed"] * (run.model.cfg.pos_emb == "learned")
    for layer in range(run.n):
        expected += [f"{layer}_attn_out"] + [f"{layer}_mlp_out"] * run.model.cfg.mlp[layer]
    assert labels == expected
    close(parts.sum(0), final_resid(run))
    for layer in range(run.n):
        close(parts[labels.index(f"{layer}_attn_out")], run.cache[f"blocks.{layer}.hook_mixer_out"])
    # up to block 1's input, and to its MLP's input where it has one
    close(run.cache.decompose_resid(layer=1).sum(0), run.cache["blocks.1.hook_resid_pre"])
    if run.model.cfg.mlp[1]:
        close(run.cache.decompose_resid(layer=1, mlp_input=True).sum(0), run.cache["blocks.1.hook_resid_mid"])


def test_logit_attrs_of_the_decomposition_sum_to_each_logit(run):
    """With the final norm's scale frozen at the run's (TransformerLens's convention), the
    attributions of parts summing to the residual sum to the logit less a constant per token."""
    parts = run.cache.decompose_resid()
    n_pos = len(run.pos)
    attrs = run.cache.logit_attrs(parts, run.answers[:, None].expand(-1, n_pos))
    assert attrs.shape == parts.shape[:-1]
    close(attrs.sum(0) + logit_offset(run.model, run.answers)[:, None], answer_logits(run, run.answers))
    wrong = (run.answers + 1) % run.model.cfg.d_vocab
    diff = run.cache.logit_attrs(parts, run.answers[:, None].expand(-1, n_pos), wrong[:, None].expand(-1, n_pos))
    offsets = logit_offset(run.model, run.answers) - logit_offset(run.model, wrong)
    close(diff.sum(0) + offsets[:, None], answer_logits(run, run.answers) - answer_logits(run, wrong))


def test_tokens_to_residual_directions_fold_in_the_final_norms_weight(run):
    model, answers = run.model, run.answers
    weight = model.ln_final.norm.weight
    directions = model.tokens_to_residual_directions(answers)
    assert directions.shape == (len(answers), model.cfg.d_model)
    close(directions, model.W_U[:, answers].T * weight)
    close(model.tokens_to_residual_directions(int(answers[0])), model.W_U[:, answers[0]] * weight)
    assert model.tokens_to_residual_directions(answers[None, :2].expand(3, 2)).shape == (3, 2, model.cfg.d_model)
    with pytest.raises(UsageError, match="no tokenizer"):
        model.tokens_to_residual_directions("a")
    with pytest.raises(UsageError, match="outside the vocabulary"):
        model.tokens_to_residual_directions(model.cfg.d_vocab)


def out_proj_input(model: hookmech.HookedLM, cache, layer: int, mixer: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The input of layer `layer`'s output projection per head ``[batch, pos, head, d_head]`` as the
    mixer computes it from its cached hooks, and the projection's weight per head ``[d_model,
    head, d_head]``: written out per mixer, from each mixer's forward, in its spec
    (`MixerSpec.head_results`)."""
    head_results = SPECS[mixer].head_results
    assert head_results is not None, f"no head computation written for {mixer} (MixerSpec.head_results)"
    inputs, weight = head_results(model.blocks[layer].mixer, lambda inside: cache[f"blocks.{layer}.mixer.hook_{inside}"])
    assert inputs.shape[-2:] == weight.shape[1:] == model.cfg.head_shape(layer)
    return inputs, weight


def test_stack_head_results_are_what_each_head_writes(run):
    heads, labels = run.cache.stack_head_results(return_labels=True)
    n_heads = run.model.cfg.n_heads
    assert labels == [f"L{layer}H{head}" for layer in range(run.n) for head in range(n_heads)]
    assert heads.shape == (run.n * n_heads, *final_resid(run).shape)
    for layer in range(run.n):
        mixer, share = run.model.cfg.mixers[layer], heads[layer * n_heads:(layer + 1) * n_heads]
        mixer_out = run.cache[f"blocks.{layer}.hook_mixer_out"]
        if mixer in HEADED:
            inputs, weight = out_proj_input(run.model, run.cache, layer, mixer)
            close(share, torch.einsum("bphd,mhd->hbpm", inputs, weight))
        else:  # a mixer without heads is one head: its output
            close(share, mixer_out[None])
        b_O = run.model.accumulated_bias(layer, mlp_input=True) - run.model.accumulated_bias(layer)
        close(share.sum(0) + b_O, mixer_out)


def test_full_resid_decomposition_sums_to_the_residual_and_its_logits(run):
    cfg = run.model.cfg
    for expand_neurons in (True, False):
        stack, labels = run.cache.get_full_resid_decomposition(expand_neurons=expand_neurons, return_labels=True)
        assert len(labels) == stack.shape[0] and labels[-1] == "bias" and "embed" in labels
        close(stack.sum(0), final_resid(run))
    stack, labels = run.cache.get_full_resid_decomposition(return_labels=True)
    heads = run.n * cfg.n_heads
    assert [label for label in labels if re.fullmatch(r"L\d+H\d+", label)] == labels[:heads]
    for layer in range(run.n):  # each MLP's neurons write its output less its bias
        if cfg.mlp[layer]:
            rows = [i for i, label in enumerate(labels) if label.startswith(f"L{layer}N")]
            assert len(rows) == cfg.d_mlp
            mlp = run.model.blocks[layer].mlp
            close(stack[rows].sum(0) + mlp.fc2.bias, run.cache[f"blocks.{layer}.hook_mlp_out"])
    # through the final norm with the run's scale, read in each answer's direction: the logits
    normed = run.cache.get_full_resid_decomposition(apply_ln=True)
    directions = run.model.tokens_to_residual_directions(run.answers)
    read = (normed * directions[None, :, None, :]).sum(-1).sum(0)
    close(read + logit_offset(run.model, run.answers)[:, None], answer_logits(run, run.answers))


def test_apply_ln_at_a_block_is_its_norm(run):
    """TransformerLens asks the final norm's kind whether to centre; each norm answers for itself here,
    so a block norm is its norm (less its weight and bias), also Mamba's RMSNorm under a LayerNorm."""
    for layer in range(run.n):
        block = run.model.blocks[layer]
        for mlp_input, norm, before, after in ((False, block.ln1, "resid_pre", "mixer_in"),
                                                (True, getattr(block, "ln2", None), "resid_mid", "mlp_in")):
            if norm is None:
                continue
            resid = run.cache[f"blocks.{layer}.hook_{before}"][None]
            normed = run.cache.apply_ln_to_stack(resid, layer=layer, mlp_input=mlp_input)[0]
            close(normed * norm.weight + getattr(norm, "bias", 0), run.cache[f"blocks.{layer}.hook_{after}"])


def test_weights_and_cfg_are_what_transformer_lens_reads(run):
    model, cfg = run.model, run.model.cfg
    assert model.W_E is model.embed.weight and model.W_E.shape == (cfg.d_vocab, cfg.d_model)
    unembedding = model.embed.weight if cfg.tie_embeddings else model.unembed.weight
    assert torch.equal(model.W_U, unembedding.T) and torch.equal(model.b_U, torch.zeros(cfg.d_vocab, dtype=torch.float64))
    if cfg.pos_emb == "learned":
        assert model.W_pos is model.pos_embed.weight
    else:
        with pytest.raises(NoComponentError, match="no position embedding"):
            model.W_pos
    assert cfg.normalization_type == {"layernorm": "LN", "rmsnorm": "RMS"}[cfg.final_norm]
    assert cfg.final_rms == (cfg.final_norm == "rmsnorm") and cfg.n_key_value_heads is None
    assert cfg.attn_only == (not any(cfg.mlp))
    assert cfg.d_mlp == cfg.mlp_hidden_mult * cfg.d_model
    assert all(block.mlp.fc1.out_features == cfg.d_mlp for block in model.blocks if block.has_mlp)


# -- transformer_lens.patching against the engine -----------------------------------------
def p_answer_metric(batch):
    """TL's patching metric: mean p(answer) at each row's query, a scalar."""
    rows = torch.arange(len(batch))
    return lambda logits: logits[rows, batch.query_pos].float().softmax(-1)[rows, batch.answers].double().mean()


def patching_model(ar_task, mixer: str) -> hookmech.HookedLM:
    options = HEAD_OPTIONS.get(mixer, {})
    return unit_variance(make_model(ar_task, mixers=mixer, d_model=16, layer_options=[options, options]))


def tl_sweep(sweep, model, batch) -> torch.Tensor:
    _, clean_cache = model.run_with_cache(batch.tokens)
    with torch.no_grad():
        return sweep(model, batch.corrupt_tokens, clean_cache, p_answer_metric(batch)).double()


def engine(model, batch, sites: list[str], positions: str) -> dict[tuple[str, str], float]:
    """{(site, pos): p_patched} of the patching engine, and it must tell a patch from no patch."""
    records = patch(model, batch, sites, [positions])
    found = {(r["site"], r["pos"]): r["p_patched"] for r in records}
    assert max(abs(p - records[0]["p_corrupt"]) for p in found.values()) > 2 * ENGINE_TOL
    return found


def assert_matches(result: torch.Tensor, expected: list) -> None:
    # contract: the engine vs a plain run_with_hooks loop, ENGINE_TOL in every p
    torch.testing.assert_close(result, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=ENGINE_TOL)


@pytest.mark.parametrize("mixer", sorted(set(REGISTRY) - {"attention"}))  # attention's: test_transformer_lens_compat
def test_tl_attn_out_patching_is_the_mixer_output_on_every_mixer(ar_task, mixer):
    model, batch = patching_model(ar_task, mixer), ar_task.sample(8, seed=4)
    found = engine(model, batch, ["L*.mixer_out"], "all")
    n_pos = batch.tokens.shape[1]
    assert_matches(tl_sweep(tl_patching.get_act_patch_attn_out, model, batch),
                   [[found[(f"L{layer}.mixer_out", str(p))] for p in range(n_pos)] for layer in range(2)])


def head_grid(found, inside: str, n_pos: int, n_heads: int) -> list:
    """[layer][pos][head] of the engine's ``L{l}.mixer.{inside}[h]`` at each position."""
    return [[[found[(f"L{layer}.mixer.{inside}[{h}]", str(p))] for h in range(n_heads)] for p in range(n_pos)]
            for layer in range(2)]


@pytest.mark.parametrize("mixer", sorted(HEAD_OUTPUT))
def test_tl_head_output_patching_is_the_mixers_head_output(ar_task, mixer):
    model, batch = patching_model(ar_task, mixer), ar_task.sample(8, seed=5)
    inside, (n_pos, n_heads) = HEAD_OUTPUT[mixer], (batch.tokens.shape[1], model.cfg.n_heads)
    assert n_heads > 1
    by_pos = engine(model, batch, [f"L*.mixer.{inside}[*]"], "all")
    assert_matches(tl_sweep(tl_patching.get_act_patch_attn_head_out_by_pos, model, batch),
                   head_grid(by_pos, inside, n_pos, n_heads))
    whole = engine(model, batch, [f"L*.mixer.{inside}[*]"], "whole")
    assert_matches(tl_sweep(tl_patching.get_act_patch_attn_head_out_all_pos, model, batch),
                   [[whole[(f"L{layer}.mixer.{inside}[{h}]", "whole")] for h in range(n_heads)] for layer in range(2)])


@pytest.mark.parametrize("mixer", sorted(QKV))
def test_tl_query_key_value_patching_is_the_mixers_own(ar_task, mixer):
    model, batch = patching_model(ar_task, mixer), ar_task.sample(8, seed=6)
    n_pos, n_heads = batch.tokens.shape[1], model.cfg.n_heads
    sweeps = {"q": tl_patching.get_act_patch_attn_head_q_by_pos, "k": tl_patching.get_act_patch_attn_head_k_by_pos,
              "v": tl_patching.get_act_patch_attn_head_v_by_pos}
    for tl_name, sweep in sweeps.items():
        inside = QKV[mixer][tl_name]
        found = engine(model, batch, [f"L*.mixer.{inside}[*]"], "all")
        assert_matches(tl_sweep(sweep, model, batch), head_grid(found, inside, n_pos, n_heads))


def test_tl_pattern_patching_is_attentions_pattern(ar_task):
    model, batch = patching_model(ar_task, "attention"), ar_task.sample(8, seed=7)
    n_pos = batch.tokens.shape[1]
    found = engine(model, batch, ["L*.mixer.pattern[*]"], "all")
    by_pos = tl_sweep(tl_patching.get_act_patch_attn_head_by_pos_every, model, batch)  # out, q, k, v, pattern
    assert by_pos.shape == (5, 2, n_pos, 2)
    assert_matches(by_pos[4], head_grid(found, "pattern", n_pos, 2))  # [layer, pos (the query), head]
    whole = engine(model, batch, ["L*.mixer.pattern[*]"], "whole")
    every = tl_sweep(tl_patching.get_act_patch_attn_head_all_pos_every, model, batch)  # out, q, k, v, pattern
    assert every.shape == (5, 2, 2)
    assert_matches(every[4], [[whole[(f"L{layer}.mixer.pattern[{h}]", "whole")] for h in range(2)] for layer in range(2)])
    # one (query, key) entry of one head's pattern: a direct run with that entry clean
    grid = tl_sweep(tl_patching.get_act_patch_attn_head_pattern_dest_src_pos, model, batch)
    _, clean = model.run_with_cache(batch.tokens)
    layer, head, query, key = 1, 1, n_pos - 1, 2

    def entry(pattern, hook):
        pattern = pattern.clone()
        pattern[:, head, query, key] = clean["blocks.1.mixer.hook_pattern"][:, head, query, key]
        return pattern

    with torch.no_grad():
        direct = p_answer_metric(batch)(model.run_with_hooks(batch.corrupt_tokens,
                                                             fwd_hooks=[("blocks.1.mixer.hook_pattern", entry)]))
    torch.testing.assert_close(grid[layer, head, query, key], direct.double(), rtol=0, atol=ENGINE_TOL)


# -- one-line refusals -------------------------------------------------------------------------
def assert_refused(call, *phrases: str) -> None:
    with pytest.raises(NoComponentError) as refused:
        call()
    message = str(refused.value)
    assert "\n" not in message and all(p in message for p in phrases), message


@pytest.mark.parametrize("source", ["mamba_ar_cpu", *WITHOUT_MLP])
def test_tl_mlp_sweeps_are_refused_in_one_line_on_blocks_without_an_mlp(ar_task, source):
    if source in FIXTURES:
        model = hookmech.load(FIXTURES[source]).eval()
        batch = hookmech.tasks.from_checkpoint(FIXTURES[source]).sample(4, seed=1)
    else:
        model, batch = patching_model(ar_task, source), ar_task.sample(4, seed=1)
    for sweep in (tl_patching.get_act_patch_resid_mid, tl_patching.get_act_patch_mlp_out,
                  tl_patching.get_act_patch_block_every):
        assert_refused(lambda: tl_sweep(sweep, model, batch), "block 0", "has no MLP")
    _, cache = model.run_with_cache(batch.tokens)
    assert_refused(lambda: cache["mlp_out", 1], "blocks.1.hook_mlp_out", "has no MLP")
    assert_refused(lambda: cache.stack_neuron_results(2), "blocks.0.mlp.hook_post", "has no MLP")


@pytest.mark.parametrize("mixer,sweep,hook", [
    *[(mixer, tl_patching.get_act_patch_attn_head_out_by_pos, "attn.hook_z")
      for mixer in sorted(set(REGISTRY) - set(HEAD_OUTPUT))],
    *[(mixer, tl_patching.get_act_patch_attn_head_q_all_pos, "attn.hook_q")
      for mixer in sorted(set(REGISTRY) - set(QKV))],
    *[(mixer, tl_patching.get_act_patch_attn_head_pattern_all_pos, "attn.hook_pattern")
      for mixer in sorted(set(REGISTRY) - {"attention"})],
])
def test_tl_head_sweeps_are_refused_in_one_line_where_the_mixer_has_no_such_hook(ar_task, mixer, sweep, hook):
    model, batch = patching_model(ar_task, mixer), ar_task.sample(4, seed=1)
    assert_refused(lambda: tl_sweep(sweep, model, batch), f"blocks.0.{hook}", f"({mixer})", "blocks.0.attn.hook_result")


# -- the names themselves ----------------------------------------------------------------------
@pytest.mark.parametrize("mixer", ["mamba", "mamba2"])
def test_transformer_lens_ssm_names_are_the_mamba_hooks(ar_task, mixer):
    """TL's Mamba bridges name the mixer's output ``mixer.hook_ssm_out``; its ``hook_ssm_state`` is
    hookmech's own name, with Mamba-2's axes [batch, pos, head, headdim, d_state]."""
    model, tokens = patching_model(ar_task, mixer), ar_task.sample(3, seed=1).tokens
    assert model.hook_aliases["blocks.1.mixer.hook_ssm_out"] == "blocks.1.hook_mixer_out"
    assert "blocks.1.mixer.hook_ssm_out" not in model.hook_dict and "blocks.1.mixer.hook_ssm_state" in model.hook_dict
    _, cache = model.run_with_cache(tokens)
    assert cache["blocks.1.mixer.hook_ssm_out"] is cache["blocks.1.hook_mixer_out"]
    zeroed = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.mixer.hook_ssm_out", lambda act, hook: act * 0)])
    expected = model.run_with_hooks(tokens, fwd_hooks=[("blocks.1.hook_mixer_out", lambda act, hook: act * 0)])
    torch.testing.assert_close(zeroed, expected, rtol=0, atol=0)  # the same computation
    if mixer == "mamba2":
        assert model.hook_dict["blocks.1.mixer.hook_ssm_state"].axes == "batch pos head headdim d_state"


@pytest.mark.parametrize("mixer", sorted(REGISTRY))
def test_transformer_lens_names_are_aliases_never_hooks(ar_task, mixer):
    model, tokens = patching_model(ar_task, mixer), ar_task.sample(3, seed=1).tokens
    assert model.hook_aliases["blocks.0.hook_attn_out"] == "blocks.0.hook_mixer_out"
    assert not set(model.hook_aliases) & set(model.hook_dict)
    assert not set(model.hook_aliases) & set(resolve_sites(["all"], model.hook_dict))
    _, cache = model.run_with_cache(tokens)
    assert len(cache) == len(model.hook_dict) and set(cache.keys()) == set(model.hook_dict)
    for alias, hook in model.hook_aliases.items():
        assert model.mod_dict[alias] is model.hook_dict[hook] and cache[alias] is cache[hook]
    # TL's analyses leave the cache's keys alone (head results are computed, never stored)
    cache.stack_head_results()
    cache.compute_head_results()
    assert set(cache.keys()) == set(model.hook_dict)


# -- head results are the cached run's, or refused -------------------------------------------
def _two_head_attention(ar_task):
    return make_model(ar_task, mixers="attention", d_model=16, layer_options=[{"n_heads": 2}] * 2).double().eval()


def zero(activation, hook):
    return activation * 0


def test_head_results_of_a_run_edited_inside_the_mixer_are_refused_not_recomputed(ar_task):
    model, batch = _two_head_attention(ar_task), ar_task.sample(4, seed=3)
    with model.hooks(fwd_hooks=[("blocks.0.mixer.hook_v", zero)]):
        _, cache = model.run_with_cache(batch.tokens)
    with pytest.raises(hookmech.HookmechError, match="edited inside the mixer") as raised:
        cache["blocks.0.attn.hook_result"]
    assert "\n" not in str(raised.value)
    assert cache["blocks.1.attn.hook_result"].shape[-2] == 2  # layer 1 was not edited


def test_reading_head_results_fires_no_hook_and_leaves_every_hook_attached(ar_task):
    model, batch = _two_head_attention(ar_task), ar_task.sample(4, seed=3)
    _, cache = model.run_with_cache(batch.tokens)
    calls = []
    with model.hooks(fwd_hooks=[("blocks.0.mixer.hook_v", lambda a, hook: calls.append(1) or a * 0)]):
        results = cache["blocks.0.attn.hook_result"]
        assert not calls
        model(batch.tokens)  # the user's hook is still attached after the read
        assert calls
    bias = model.blocks[0].head_result_bias()
    # FLOAT64_SUM_TOL: the heads and the mixer output are one float64 sum in two orders
    close(results.sum(-2) + bias, cache["blocks.0.hook_mixer_out"])


def test_membership_agrees_with_reading(ar_task):
    model, batch = _two_head_attention(ar_task), ar_task.sample(4, seed=3)
    _, cache = model.run_with_cache(batch.tokens)
    for name in ("blocks.0.attn.hook_result", "ln_final.hook_scale", "blocks.0.mlp.hook_post", "blocks.0.attn.hook_z"):
        assert name in cache
        cache[name]
    mamba = make_model(ar_task, mixers="mamba", d_model=16)
    _, mamba_cache = mamba.run_with_cache(batch.tokens)
    assert "blocks.0.mlp.hook_post" not in mamba_cache and "blocks.0.attn.hook_z" not in mamba_cache


def test_layers_with_different_head_counts_are_refused_by_transformer_lens_head_tools(ar_task):
    model = make_model(ar_task, mixers="attention", d_model=16, layer_options=[{"n_heads": 1}, {"n_heads": 2}])
    batch = ar_task.sample(4, seed=3)
    _, cache = model.run_with_cache(batch.tokens)
    with pytest.raises(NoComponentError, match=r"\[1, 2\] heads"):
        tl_patching.get_act_patch_attn_head_out_all_pos(model, batch.corrupt_tokens, cache, lambda logits: logits.sum())
    with pytest.raises(NoComponentError, match=r"\[1, 2\] heads"):
        cache.stack_head_results()
    # what does not depend on a head count still runs
    tl_patching.get_act_patch_resid_pre(model, batch.corrupt_tokens, cache, lambda logits: logits.sum())
