"""Distributed alignment search (hookmech.das): its patched forwards against plain run_with_hooks,
full rank against `hookmech.patching.patch`, a planted subspace recovered, determinism."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import ENGINE_TOL, REPO
from safetensors.torch import load_file

import hookmech
from hookmech.cache import answer_probs, write_cache
from hookmech.config import build_config
from hookmech.das import BoundlessIntervention, SubspaceIntervention, random_basis, train
from hookmech.das.data import DasData
from hookmech.das.patched import SubspacePatch, patched_logits
from hookmech.errors import UsageError
from hookmech.patching import patch
from hookmech.sites import row_positions, site_to_hook
from hookmech.tasks.batch import Batch

ATTENTION = REPO / "fixtures" / "attention_ar_cpu.safetensors"
MAMBA = REPO / "fixtures" / "mamba_ar_cpu.safetensors"


def _cache(path, tmp_dir, sites, n=40, seed=1):
    model, task = hookmech.load(path), hookmech.tasks.from_checkpoint(path)
    batch = task.sample(n, seed=seed)
    hooks = [site_to_hook(site) for site in sites]
    return model, write_cache(model, batch, tmp_dir / f"{path.stem}.h5", hooks, task_spec=task.spec)


@pytest.fixture(scope="module")
def attention_cache(tmp_path_factory):
    """The CPU attention fixture and a 40-row cache of its block inputs, mixer inputs and layer 1's keys."""
    sites = ["L0.block_in", "L1.block_in", "L1.mixer_in", "L1.mixer.k"]
    return _cache(ATTENTION, tmp_path_factory.mktemp("das"), sites)


@pytest.fixture(scope="module")
def mamba_cache(tmp_path_factory):
    """The CPU Mamba fixture and a 40-row cache: block inputs, mixer inputs, layer 0's SSM states."""
    sites = ["L0.block_in", "L1.block_in", "L0.mixer_in", "L1.mixer_in", "L0.mixer.ssm_state"]
    return _cache(MAMBA, tmp_path_factory.mktemp("das"), sites)


# -- the patched forwards ----------------------------------------------------------------------
def plain_patched_probs(model, batch, hook, positions, basis):
    """p(answer) at the query of the corrupt run with x -> x + Q Qᵀ (x_clean − x) at each row's
    position of `hook` (flattened), written plainly: full forwards from the tokens with
    run_with_hooks, the clean activations from run_with_cache (no cache file, no resumed run)."""
    _, clean = model.run_with_cache(batch.tokens, names_filter=hook)
    rows = torch.arange(len(batch))

    def intervene(activation, hook=None):
        moved = activation.movedim(model.hook_dict[hook.name].pos_axis, 1).clone()
        x = moved[rows, positions].flatten(1)
        source = clean[hook.name].movedim(model.hook_dict[hook.name].pos_axis, 1)[rows, positions].flatten(1)
        moved[rows, positions] = (x + (source - x) @ basis @ basis.T).view(moved[rows, positions].shape)
        return moved.movedim(1, model.hook_dict[hook.name].pos_axis)

    logits = model.run_with_hooks(batch.corrupt_tokens, fwd_hooks=[(hook, intervene)])
    return answer_probs(logits[rows, batch.query_pos], batch.answers)


@pytest.mark.parametrize(
    ("which", "site", "pos", "route"),
    [
        ("attention", "L1.block_in", "value", "resumed"),
        ("attention", "L0.block_out", "value", "resumed"),
        ("attention", "L1.mixer.k", "value", "resumed"),
        ("mamba", "L1.block_in", "key", "resumed"),
        ("mamba", "L0.mixer.ssm_state", "key", "resumed"),
    ],
)
@torch.no_grad()
def test_patched_forwards_equal_plain_run_with_hooks(which, site, pos, route, attention_cache, mamba_cache):
    """A fixed random basis: DAS's forwards (resumed from the patched block and position, inside
    hooks included since the engine resumes them, the state patch propagating) give
    the p(answer) of plain forwards from the tokens, to ENGINE_TOL (the engine's contract); a small
    chunk size changes nothing."""
    model, path = attention_cache if which == "attention" else mamba_cache
    with hookmech.cache.open(path) as cache:
        hook = site_to_hook(site)
        for chunk_rows in (512, 7):
            data = DasData(model, cache, hook, pos, chunk_rows=chunk_rows)
            assert (data.route.resume_at is not None) == (route == "resumed")
            basis = random_basis(data.d, 3, seed=5)
            intervention = SubspaceIntervention(basis, trainable=False)
            every = torch.ones(cache.n, dtype=torch.bool)
            probs = torch.zeros(cache.n)
            hook_patch = SubspacePatch(data.route.pos_axis)
            with model.hooks(fwd_hooks=[(data.route.hook, hook_patch)]):
                for chunk in data.chunks(every):
                    assert len(chunk) <= chunk_rows
                    index = torch.arange(len(chunk))
                    logits = patched_logits(model, data.route, chunk, index, hook_patch, intervention)
                    probs[chunk.rows] = answer_probs(logits, chunk.answers)
            batch = cache.batch()
        positions = row_positions(pos, batch.roles, batch.lengths)
        reference = plain_patched_probs(model, batch, hook, positions, basis)
        corrupt = hookmech.cache.open(path).p_answer("corrupt")
    assert (reference - corrupt).abs().max() > 1e-3  # the patch changes something
    torch.testing.assert_close(probs, reference, rtol=0, atol=ENGINE_TOL)


# -- full rank is vanilla interchange ------------------------------------------------------------
@pytest.mark.parametrize(
    ("which", "site", "pos"),
    [
        ("attention", "L1.block_in", "value"),
        ("attention", "L0.block_in", "key"),
        ("mamba", "L1.block_in", "key"),
    ],
)
def test_full_rank_equals_patch_at_that_cell(which, site, pos, attention_cache, mamba_cache):
    """K = d: a trained basis spans everything, so DAS is the vanilla interchange of `hookmech
    patch` at that cell, on the same dev rows: attribution to ENGINE_TOL (p(answer) per row from
    `patch(per_example=True)`) and IIA equal to the argmax of a plain run_with_hooks interchange."""
    model, path = attention_cache if which == "attention" else mamba_cache
    result = train(model, path, site, pos, dims=[64], steps=3, batch_size=16, seed=2)
    (record,) = result.records
    dev = result.dev_rows
    assert record["dim"] == record["d"] == 64 and record["n_dev"] == len(dev) > 0
    (cell,) = patch(model, path, site, pos, per_example=True)
    with hookmech.cache.open(path) as cache:
        p_clean, p_corrupt = (cache.p_answer(which).double()[dev].mean().item() for which in ("clean", "corrupt"))
        batch = cache.batch().select(dev)
    p_patched = torch.tensor(cell["p_patched_rows"], dtype=torch.float64)[dev].mean().item()
    expected = (p_patched - p_corrupt) / (p_clean - p_corrupt)
    assert abs(expected) > 0.05  # a cell where the interchange matters
    assert record["attribution"] == pytest.approx(expected, abs=ENGINE_TOL)
    assert record["attribution_full"] == pytest.approx(expected, abs=ENGINE_TOL)
    hook = site_to_hook(site)
    _, clean = model.run_with_cache(batch.tokens, names_filter=hook)
    rows, positions = torch.arange(len(batch)), row_positions(pos, batch.roles, batch.lengths)

    def interchange(activation, hook):
        activation = activation.clone()
        activation[rows, positions] = clean[hook.name][rows, positions]
        return activation

    logits = model.run_with_hooks(batch.corrupt_tokens, fwd_hooks=[(hook, interchange)])
    iia = (logits[rows, batch.query_pos].argmax(-1) == batch.answers).double().mean().item()
    assert record["iia"] == record["iia_full"] == iia


def test_training_reads_the_cache_in_chunks(attention_cache, monkeypatch):
    """With chunks of 7 rows every read holds at most 7 rows, training visits every chunk, and the
    scores that do not depend on training (the full interchange) are those of one big chunk."""
    model, path = attention_cache
    sizes = []
    original = DasData.chunk

    def spy(self, rows, keep):
        chunk = original(self, rows, keep)
        sizes.append((rows.start, rows.stop - rows.start, len(chunk)))
        return chunk

    monkeypatch.setattr(DasData, "chunk", spy)
    small = train(model, path, "L1.block_in", "value", dims=[2], steps=12, batch_size=4, chunk_rows=7)
    assert sizes and all(read <= 7 and kept <= read for _, read, kept in sizes)
    assert {start for start, _, _ in sizes} == set(range(0, 40, 7))  # 12 steps of 4 rows: every chunk
    big = train(model, path, "L1.block_in", "value", dims=[2], steps=1, batch_size=4)
    assert small.records[0]["n_dev"] == big.records[0]["n_dev"]
    # forwards of 7-row and 40-row chunks: two batchings of the engine's runs, so ENGINE_TOL
    for key in ("iia_full", "attribution_full", "p_clean", "p_corrupt"):
        assert small.records[0][key] == pytest.approx(big.records[0][key], abs=ENGINE_TOL), key


# -- a planted subspace --------------------------------------------------------------------------
D_MODEL, POSITIVE, NEGATIVE, YES, NO = 16, range(0, 4), range(4, 8), 8, 9
STEPS, LR = 100, 2e-2


def planted_model(seed: int = 0):
    """A 1-layer attention LM whose answer is carried by one direction u of the final norm's
    output at the query (the logits are linear in it): its mixer and MLP write zero, token t embeds
    as s_t u + n_t (s_t = +1 for tokens 0..3, −1 for 4..7; n_t orthogonal to u and to the
    all-ones vector, larger than s_t u, the same four vectors for both signs), so that after the
    LayerNorm only u tells the signs apart, and the head reads ±2 u: answer YES where s > 0, else
    NO. Returns (model, u)."""
    generator = torch.Generator().manual_seed(seed)
    ones = torch.ones(D_MODEL) / D_MODEL**0.5
    u = torch.randn(D_MODEL, generator=generator)
    u = u - (u @ ones) * ones
    u = u / u.norm()
    noise = torch.randn(4, D_MODEL, generator=generator) * 1.5
    noise = noise - (noise @ ones)[:, None] * ones - (noise @ u)[:, None] * u
    model = hookmech.HookedLM(
        build_config(d_vocab=10, n_ctx=2, mixers="attention", d_model=D_MODEL, n_layers=1, tie_embeddings=False)
    ).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            is_norm_weight = name.endswith("weight") and parameter.dim() == 1
            parameter.copy_(torch.ones_like(parameter) if is_norm_weight else torch.zeros_like(parameter))
        signs = torch.tensor([1.0] * 4 + [-1.0] * 4)
        model.embed.weight[:8] = signs[:, None] * u + noise[[0, 1, 2, 3, 2, 0, 3, 1]]
        model.unembed.weight[YES], model.unembed.weight[NO] = 2 * u, -2 * u
    return model, u


def planted_cache(model, path, n: int = 200, seed: int = 0):
    """Rows ``[filler, query]``: the clean query token's sign decides the answer, the corrupt row's
    query has the other sign (so the corrupt run answers the other way)."""
    generator = torch.Generator().manual_seed(seed)
    positive = torch.rand(n, generator=generator) < 0.5
    pick = lambda tokens: torch.tensor(tokens)[torch.randint(0, 4, (n,), generator=generator)]  # noqa: E731
    clean_query = torch.where(positive, pick(POSITIVE), pick(NEGATIVE))
    corrupt_query = torch.where(positive, pick(NEGATIVE), pick(POSITIVE))
    filler = torch.randint(0, 8, (n,), generator=generator)
    batch = Batch(
        tokens=torch.stack([filler, clean_query], 1),
        corrupt_tokens=torch.stack([filler, corrupt_query], 1),
        answers=torch.where(positive, YES, NO),
        lengths=torch.full((n,), 2),
        doc_index=torch.arange(n),
        roles={"query": torch.ones(n, dtype=torch.long)},
    )
    return write_cache(model, batch, path, ["ln_final.hook_normalized", "blocks.0.hook_resid_post"])


def test_planted_direction_is_recovered_and_the_random_control_fails(tmp_path):
    """K = 1 finds the planted direction (|cos| >= 0.99, the issue's bar) and restores the answer
    as the whole activation does, while a random 1-d basis does not."""
    model, u = planted_model()
    path = planted_cache(model, tmp_path / "planted.h5")
    result = train(model, path, "final_norm", "query", dims=[1], steps=STEPS, batch_size=32, lr=LR, seed=0)
    (record,) = result.records
    learned = result.bases["dim1"][:, 0]
    assert abs(torch.dot(learned, u).item()) >= 0.99
    assert record["iia_full"] == 1.0 and record["iia"] == record["iia_full"]
    assert record["attribution"] > 0.9
    assert abs(torch.dot(result.bases["random_dim1"][:, 0], u).item()) < 0.5
    assert record["iia_random"] < 0.6


def test_boundless_learns_the_planted_dimension(tmp_path):
    """Boundless DAS on the planted model ends with a small boundary whose subspace holds u and
    restores the answer; its record says the learned dimension."""
    model, u = planted_model()
    path = planted_cache(model, tmp_path / "planted.h5")
    result = train(model, path, "final_norm", "query", boundless=True, steps=300, batch_size=32, lr=LR, seed=0)
    (record,) = result.records
    dim = record["dim"]
    basis = result.bases[f"dim{dim}"]
    assert record["boundless"] and 1 <= dim <= 3 and basis.shape == (D_MODEL, dim)
    assert (basis.T @ u).norm().item() >= 0.99  # u lies (almost) in the learned subspace
    assert record["iia"] == record["iia_full"] == 1.0
    assert result.bases["rotation"].shape == (D_MODEL, D_MODEL)


def test_boundless_mask_exchanges_the_first_coordinates():
    """At a low temperature the boundary b exchanges round(b·d) rotated coordinates: the boundless
    intervention equals the subspace intervention on the rotation's first columns."""
    rotation = random_basis(8, 8, seed=1)
    intervention = BoundlessIntervention(rotation, seed=0)
    with torch.no_grad():
        intervention.boundary.fill_(3 / 8)
    intervention.set_temperature(1e-3)
    base, source = torch.randn(5, 8), torch.randn(5, 8)
    assert intervention.learned_dim() == 3
    expected = SubspaceIntervention(rotation[:, :3], trainable=False)(base, source)
    torch.testing.assert_close(intervention(base, source), expected, rtol=0, atol=1e-5)


# -- bases --------------------------------------------------------------------------------------
def test_random_basis_is_orthonormal_and_seeded():
    basis = random_basis(32, 5, seed=3)
    torch.testing.assert_close(basis.T @ basis, torch.eye(5), rtol=0, atol=1e-6)
    assert torch.equal(basis, random_basis(32, 5, seed=3))
    assert not torch.equal(basis, random_basis(32, 5, seed=4))


def test_the_trained_basis_stays_orthonormal_and_the_model_untouched(attention_cache):
    model, path = attention_cache
    before = {name: parameter.clone() for name, parameter in model.state_dict().items()}
    grads = [parameter.requires_grad for parameter in model.parameters()]
    result = train(model, path, "L1.block_in", "value", dims=[4], steps=10, batch_size=16)
    basis = result.bases["dim4"]
    torch.testing.assert_close(basis.T @ basis, torch.eye(4), rtol=0, atol=1e-5)
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert [parameter.requires_grad for parameter in model.parameters()] == grads


# -- determinism --------------------------------------------------------------------------------
def test_same_seed_same_basis_bytes(attention_cache, tmp_path):
    model, path = attention_cache

    def run(seed, folder):
        result = train(model, path, "L1.block_in", "value", dims=[1, 2], steps=8, batch_size=16, seed=seed)
        result.save(tmp_path / folder)
        return (tmp_path / folder / "bases.safetensors").read_bytes(), (tmp_path / folder / "records.json").read_text()

    first, again, other = run(0, "a"), run(0, "b"), run(1, "c")
    assert first == again
    assert first[0] != other[0]
    saved = load_file(tmp_path / "a" / "bases.safetensors")
    assert sorted(saved) == ["dim1", "dim2", "random_dim1", "random_dim2"] and saved["dim2"].shape == (64, 2)


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("site", "pos", "options", "message"),
    [
        ("L1.block_in", "value", {"dims": [65]}, "1 <= K <= 64"),
        ("L1.block_in", "value", {"dims": [0]}, "integer >= 1"),
        ("L1.block_in", "value", {}, "--dim K[,K...]) or --boundless"),
        ("L1.block_in", "value", {"dims": [1], "boundless": True}, "not both"),
        ("L1.block_in", "all", {"dims": [1]}, "one position per row, not 'all'"),
        ("L1.block_in", "key+value", {"dims": [1]}, "one position per row"),
        ("L*.block_in", "value", {"dims": [1]}, "names 2 sites"),
        ("L1.mixer.z[0]", "value", {"dims": [1]}, "one plain site"),
        ("L1.mlp_out", "value", {"dims": [1]}, "no clean activations for site"),
        ("L1.block_in", "value", {"dims": [1], "steps": 0}, "steps must be >= 1"),
        ("L1.block_in", "value", {"dims": [1], "lr": math.nan}, "learning rate must be a positive number"),
        ("L1.block_in", "value", {"dims": [1], "batch_size": 0}, "batch size must be >= 1"),
    ],
)
def test_bad_input_is_a_usage_error(site, pos, options, message, attention_cache):
    model, path = attention_cache
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        train(model, path, site, pos, **options)


def test_boundless_refuses_a_rotation_wider_than_it_trains():
    with pytest.raises(UsageError, match="learn low-rank bases of given dimensions instead"):
        BoundlessIntervention(torch.eye(2048), seed=0)
