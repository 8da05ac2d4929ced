# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # hookmech in 15 minutes: induction at the value, or retrieval at the query?
#
# Two small models solve associative recall (AR) perfectly. Do they solve it the same way?
# This notebook answers the question the way Arora et al. do in *Mechanistic evaluation of
# Transformers and state space models* (2025): with **interchange interventions** (activation
# patching). It uses the two checkpoints bundled with hookmech, so it runs on a laptop CPU in
# about a minute:
#
# - `attention_ar_cpu.safetensors`: a 2-layer attention model (layer 0 sees a window of 2 tokens);
# - `mamba_ar_cpu.safetensors`: a 2-layer Mamba.
#
# An AR document lists key–value pairs, then repeats one key; the model must answer with its
# value: `BOS k₀ v₀ k₁ v₁ … DIV k_q → v_q`. A model can find the answer in two ways:
#
# - **induction**: layer 0 copies each key into the position of the value that follows it (the
#   association is *stored at the value*); layer 1, at the query, looks for the position whose
#   stored key matches and reads its value;
# - **direct retrieval**: the query position gathers the answer straight from the context,
#   without anything stored at the value.
#
# We will tell them apart by corrupting the document and restoring one activation at a time.
# Every cell below is plain PyTorch on a TransformerLens `HookedRootModule`, plus a few hookmech
# helpers that do the same thing faster.

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's notebook widgets, unused here

import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

import hookmech
import hookmech.probe
from hookmech.demo import fixture_dir, mechanism  # where `hookmech demo` finds the bundled checkpoints
from hookmech.fileio import sha256_of
from hookmech.sites import resolve_sites

torch.manual_seed(0)  # nothing below is random except through explicit seeds; this is belt and braces
FIXTURES = fixture_dir()
ATTENTION = FIXTURES / "attention_ar_cpu.safetensors"
MAMBA = FIXTURES / "mamba_ar_cpu.safetensors"
print("bundled checkpoints:", sorted(path.name for path in FIXTURES.glob("*.safetensors")))

# %% [markdown]
# ## 1. The task and its corruption
#
# A checkpoint records the task it was trained on, so `tasks.from_checkpoint` rebuilds it.
# `task.sample(n, seed)` is a pure function of the seed: it returns a `Batch` with the clean
# `tokens`, the `corrupt_tokens` (the queried key's first occurrence is replaced by a key that
# appears nowhere, so the document no longer says what the answer is), the `answers`, and the
# position of each **role** (`key`, `value`, `query`, `divider`) in every row.

# %%
task = hookmech.tasks.from_checkpoint(ATTENTION)
batch = task.sample(320, seed=1)
print(task.spec)
print("clean:  ", task.describe_tokens(batch.tokens[0].tolist()))
print("corrupt:", task.describe_tokens(batch.corrupt_tokens[0].tolist()))
print("answer: ", task.describe_tokens([int(batch.answers[0])]))
print("roles of row 0:", {role: int(pos[0]) for role, pos in batch.roles.items()})

# %% [markdown]
# ## 2. A hooked model and its cache
#
# `hookmech.load` returns a `HookedLM`, a TransformerLens `HookedRootModule`: `run_with_cache`,
# `run_with_hooks` and `hooks()` are TransformerLens's own. hookmech also gives the hooks short
# **site** names: `L1.block_in` is `blocks.1.hook_resid_pre`, the residual stream entering layer 1.

# %%
model = hookmech.load(ATTENTION)
rows = torch.arange(len(batch))
query = batch.roles["query"]


def p_answer(logits):
    """p(answer) of each row, read at its query position."""
    return logits[rows, query].softmax(-1)[rows, batch.answers]


with torch.no_grad():
    clean_logits, clean_cache = model.run_with_cache(batch.tokens)
    corrupt_logits = model(batch.corrupt_tokens)
p_clean, p_corrupt = p_answer(clean_logits).mean().item(), p_answer(corrupt_logits).mean().item()
accuracy = (clean_logits[rows, query].argmax(-1) == batch.answers).float().mean().item()
print(f"accuracy {accuracy:.3f}   mean p(answer): clean {p_clean:.4f}, corrupt {p_corrupt:.4f}")
print(len(clean_cache), "cached hooks, e.g.", [name for name in clean_cache.keys() if name.startswith("blocks.1.")][:6])
print("L1.block_in ->", hookmech.sites.site_to_hook("L1.block_in"), tuple(clean_cache["blocks.1.hook_resid_pre"].shape))

# %% [markdown]
# The attention patterns already hint at induction: in layer 0 the value position attends to the
# key just before it (a previous-token head), and in layer 1 the query attends to the *value*
# of the matching pair, not to the key.

# %%
key, value = batch.roles["key"], batch.roles["value"]
pattern0 = clean_cache["blocks.0.mixer.hook_pattern"][:, 0]  # [row, query position, key position], head 0
pattern1 = clean_cache["blocks.1.mixer.hook_pattern"][:, 0]
print(f"layer 0, value -> its key:      mean attention {pattern0[rows, value, key].mean():.3f}")
print(f"layer 1, query -> matching value: mean attention {pattern1[rows, query, value].mean():.3f}")
print(f"layer 1, query -> matching key:   mean attention {pattern1[rows, query, key].mean():.3f}")

# %% [markdown]
# ## 3. Patching by hand with `run_with_hooks`
#
# Run the **corrupt** document, but at one site and one position put back the activation of the
# **clean** run. If p(answer) comes back, that activation carries the information the corruption
# destroyed. Averaged over the rows, the attribution score (paper 000, eq. 1) is
#
# $$\text{attribution} = \frac{\bar p_\text{patched} - \bar p_\text{corrupt}}{\bar p_\text{clean} - \bar p_\text{corrupt}}$$
#
# 1 means this one activation restores the whole clean-vs-corrupt difference, 0 that it restores
# nothing.

# %%
HOOK = "blocks.1.hook_resid_pre"  # L1.block_in
clean_act = clean_cache[HOOK]


def restore_at(positions):
    """A forward hook that puts the clean run's activation back at one position per row."""
    def hook(activation, hook):
        activation = activation.clone()
        activation[rows, positions] = clean_act[rows, positions]
        return activation
    return hook


by_hand = {}
with torch.no_grad():
    for role in ("key", "value", "query", "divider"):
        patched_logits = model.run_with_hooks(batch.corrupt_tokens, fwd_hooks=[(HOOK, restore_at(batch.roles[role]))])
        p_patched = p_answer(patched_logits).mean().item()
        by_hand[role] = (p_patched - p_corrupt) / (p_clean - p_corrupt)
        print(f"L1.block_in at {role:8s} p_patched {p_patched:.4f}   attribution {by_hand[role]:+.3f}")

# %% [markdown]
# Restoring layer 1's input **at the value** alone brings the answer back: layer 0 wrote the
# key–value association into the value position, and layer 1 reads it there. That is induction.
#
# ## 4. The same with `hookmech.patching.patch`
#
# `patch` does exactly this for any list of sites × positions and returns one record per cell.
# It gets the same numbers as the loop above (to 1e-5 on every architecture) several times
# faster, by re-running each patch only from the patched layer and position onwards.

# %%
records = hookmech.patching.patch(model, batch, sites=["L1.block_in"], positions=["key", "value", "query", "divider"])
for record in records:
    print(f"{record['site']} at {record['pos']:8s} attribution {record['attribution']:+.3f}"
          f"   (by hand {by_hand[record['pos']]:+.3f}; passes filter: {record['passes_filter']})")
assert all(abs(r["attribution"] - by_hand[r["pos"]]) < 1e-4 for r in records)

# %% [markdown]
# ## 5. Every site × position, for both models
#
# Now the Mamba model. It has no attention pattern to look at, but patching works on any
# architecture: the sites are the same block boundaries (Mamba blocks have no MLP). `all` names
# every block-level site of the model.

# %%
mamba = hookmech.load(MAMBA)
mamba_task = hookmech.tasks.from_checkpoint(MAMBA)
mamba_batch = mamba_task.sample(320, seed=1)
POSITIONS = ["key", "value", "query", "divider"]
grids = {
    "attention": hookmech.patching.patch(model, batch, sites=["all"], positions=POSITIONS),
    "mamba": hookmech.patching.patch(mamba, mamba_batch, sites=["all"], positions=POSITIONS),
}


def heatmap(ax, records, title):
    sites = list(dict.fromkeys(r["site"] for r in records))
    grid = np.array([[next(r["attribution"] for r in records if r["site"] == s and r["pos"] == p) for p in POSITIONS]
                     for s in sites])
    image = ax.imshow(grid, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
    for (i, j), v in np.ndenumerate(grid):
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8, color="white" if abs(v) > 0.6 else "black")
    ax.set_xticks(range(len(POSITIONS)), POSITIONS)
    ax.set_xlabel("patched position")
    ax.set_yticks(range(len(sites)), sites)
    ax.set_title(title)
    return image


fig, axes = plt.subplots(1, 2, figsize=(10, 5), constrained_layout=True)
for ax, (name, recs) in zip(axes, grids.items()):
    image = heatmap(ax, recs, f"{name}: attribution (denoising the key)")
fig.colorbar(image, ax=axes, label="attribution", shrink=0.8)
plt.show()

for name, recs in grids.items():
    cells = {r["pos"]: r["attribution"] for r in recs if r["site"] == "L1.block_in"}
    print(f"{name:9s} L1.block_in: value {cells['value']:+.2f}, query {cells['query']:+.2f}, key {cells['key']:+.2f}"
          f"  -> {mechanism(recs)}")

# %% [markdown]
# Read the `L1.block_in` row. For attention, everything sits at the **value** (induction). For
# Mamba, nothing sits at the value: the answer reaches the query directly — part of it already
# in layer 0 (`query` ≈ 0.43: layer 0 retrieved it into the query position), the rest through
# the key's position in layer 1 (`key` ≈ 0.56). That is **direct retrieval**, the mechanism the
# paper finds for the SSMs. Both models end at `L1.mixer_out` = 1 at the query: the answer is
# written there last, whatever the route.
#
# ## 6. An activation cache on disk
#
# For bigger experiments, cache the clean and corrupt activations once to HDF5 and analyse them
# later (`hookmech cache` on the command line). `hookmech.cache.open` reads the file lazily:
# indexing returns an h5py dataset, and nothing is read until you slice it.

# %%
tmp = Path(tempfile.mkdtemp())
cache_path = tmp / "attention_cache.h5"
hookmech.cache.write_cache(model, batch, cache_path, resolve_sites(["all"], model.hook_dict),
                           model_sha256=sha256_of(ATTENTION), task_spec=task.spec)
cache = hookmech.cache.open(cache_path)
summary = cache.summary()
print({k: summary[k] for k in ("n", "n_pos", "task")}, f"p_clean {summary['p_clean']:.4f}, p_corrupt {summary['p_corrupt']:.4f}")
dataset = cache["blocks.1.hook_resid_pre"]  # clean run; cache["...", "corrupt"] for the other
print(type(dataset).__name__, dataset.shape, "- read lazily; one row:", tuple(dataset[0].shape))
print("L1.block_in at each row's value:", tuple(cache.at("L1.block_in", "value").shape))

# patching from the cache reads the clean activations and corrupt residuals from the file
from_cache = hookmech.patching.patch(model, cache, ["L1.block_in"], POSITIONS)
print({r["pos"]: round(r["attribution"], 3) for r in from_cache})

# %% [markdown]
# ## 7. A probe: is the key stored at the value?
#
# Patching is causal: it says what the model *uses*. A linear probe is a second, correlational
# view: can the queried **key** be decoded (multinomial logistic regression, held-out documents)
# from `L1.block_in` at the **value** position? Under induction it must be there; under direct
# retrieval it need not be.

# %%
mamba_path = tmp / "mamba_cache.h5"
hookmech.cache.write_cache(mamba, mamba_batch, mamba_path, resolve_sites(["all"], mamba.hook_dict),
                           model_sha256=sha256_of(MAMBA), task_spec=mamba_task.spec)
with hookmech.cache.open(mamba_path) as mamba_cache:
    for name, c in (("attention", cache), ("mamba", mamba_cache)):
        result = hookmech.probe.fit_probe(c, "L1.block_in", "value", target="key", seed=0)
        print(f"{name:9s} key decoded from L1.block_in at the value: held-out accuracy "
              f"{result.heldout_accuracy:.2f} (chance {result.chance:.2f}, {result.n_classes} keys)")
cache.close()

# %% [markdown]
# The attention model's layer-1 input at the value holds the key it follows (the previous-token
# head of layer 0 put it there); Mamba's does not. Two models with the same accuracy, two
# different mechanisms — the point of a *mechanistic* evaluation.
#
# ## Where next
#
# - The command line does all of this on your own checkpoints: `hookmech train`, `hookmech cache`,
#   `hookmech patch --site 'L*.block_in' --pos key,value,query`, `hookmech probe`; `hookmech demo`
#   is sections 5–6 in one command.
# - Inside-the-mixer sites (`L1.mixer.q`, Mamba's `L0.mixer.conv` …), heads (`L1.mixer.z[0]`),
#   noising, ablations, other metrics and attribution patching: see the user guide.
# - Sweeps over architectures and learning rates, and the paper's figures: `hookmech sweep`,
#   `hookmech report`.
