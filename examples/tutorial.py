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
# patching). It uses two of the checkpoints bundled with hookmech, so it runs on a laptop CPU in
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
# Every cell below is plain PyTorch on a TransformerLens `HookedRootModule`, plus hookmech's public
# API, which does the same thing faster; the last section shows its other tools (attribution
# patching, distributed alignment search, path patching and the `view` page) in a few cells each.

# %%
import warnings

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm's notebook widgets, unused here

import tempfile
from pathlib import Path

import torch
from IPython.display import Image, display

import hookmech
import hookmech.probe
import hookmech.report
import hookmech.view

torch.manual_seed(0)  # nothing below is random except through explicit seeds; this is belt and braces
ATTENTION = hookmech.fixture("attention_ar_cpu")  # the bundled checkpoints, wherever hookmech is installed
MAMBA = hookmech.fixture("mamba_ar_cpu")
print("bundled checkpoints:", ATTENTION.name, MAMBA.name)

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
#
# Part of the first pattern is forced, though: this CPU fixture's layer 0 sees a **window of 2
# tokens** (`window=2` below: each position and the one before it), so at the value it can only
# choose between itself and its key, and uniform attention would already put 0.5 on the key. What
# training decided is the rest of the way to 1. (The paper-configuration fixture,
# `hookmech.fixture("attention_ar_paper")`, has no window in layer 0 and learns the pattern all the
# same: 0.92.)

# %%
key, value = batch.roles["key"], batch.roles["value"]
pattern0 = clean_cache["blocks.0.mixer.hook_pattern"][:, 0]  # [row, query position, key position], head 0
pattern1 = clean_cache["blocks.1.mixer.hook_pattern"][:, 0]
print(f"layer 0, value -> its key:      mean attention {pattern0[rows, value, key].mean():.3f}")
print(f"layer 1, query -> matching value: mean attention {pattern1[rows, query, value].mean():.3f}")
print(f"layer 1, query -> matching key:   mean attention {pattern1[rows, query, key].mean():.3f}")
print("layer 0's options:", model.cfg.mixer_kwargs[0])

# %% [markdown]
# `hookmech.induction_scores` reads the same two weights off every layer and head, of any mixer
# (its effective attention, section 9 of the guide), on the task's own documents: `query->value`
# is the induction head's step, `value->key` the previous-token step.

# %%
for layer, by_name in hookmech.induction_scores(model, batch).items():
    print(f"layer {layer}:", {name: round(values.item(), 3) for name, values in by_name.items()})

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
# every block-level site of the model. `hookmech.report.plot_heatmap` draws the records as
# `hookmech report` and `hookmech patch -o heatmap.png` do.

# %%
mamba = hookmech.load(MAMBA)
mamba_task = hookmech.tasks.from_checkpoint(MAMBA)
mamba_batch = mamba_task.sample(320, seed=1)
POSITIONS = ["key", "value", "query", "divider"]
grids = {
    "attention": hookmech.patching.patch(model, batch, sites=["all"], positions=POSITIONS),
    "mamba": hookmech.patching.patch(mamba, mamba_batch, sites=["all"], positions=POSITIONS),
}
tmp = Path(tempfile.mkdtemp())
for name, recs in grids.items():
    hookmech.report.plot_heatmap(recs, tmp / f"{name}.png", f"{name}: attribution (denoising the key)")
    display(Image(filename=tmp / f"{name}.png"))

for name, recs in grids.items():
    cells = {r["pos"]: r["attribution"] for r in recs if r["site"] == "L1.block_in"}
    found = "induction" if cells["value"] > 0.5 else "direct retrieval"  # is the association read at the value?
    print(f"{name:9s} L1.block_in: value {cells['value']:+.2f}, query {cells['query']:+.2f}, key {cells['key']:+.2f}"
          f"  -> {found}")

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
cache_path = tmp / "attention_cache.h5"
hookmech.cache.write_cache(model, batch, cache_path, ["all"], task_spec=task.spec)  # every block-level site
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
hookmech.cache.write_cache(mamba, mamba_batch, mamba_path, ["all"], task_spec=mamba_task.spec)
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
# ## 8. More tools, a few cells each
#
# ### Attribution patching: every cell from one backward pass
#
# `method="atp"` estimates every site × position at once from gradients (Nanda 2023): a forward
# and a backward pass instead of a patched run per cell. It is a first-order estimate, and
# p(answer) is saturated here (the clean run is at 0.9996), so it misses most of each effect.
# AtP* (Kramár et al. 2024) recomputes the softmax at the patched position and reads a metric that
# does not saturate.

# %%
estimates = {method: hookmech.patching.patch(model, batch, ["all"], POSITIONS, method=method)
             for method in ("atp", "atp-star")}
exact = {(r["site"], r["pos"]): r["attribution"] for r in grids["attention"]}
for site, pos in [("L1.mixer_out", "query"), ("L1.block_in", "value"), ("L0.block_in", "key")]:
    atp, star = (next(r["attribution"] for r in estimates[m] if (r["site"], r["pos"]) == (site, pos)) for m in estimates)
    print(f"{site:12s} at {pos:5s}  AtP {atp:.2f}   AtP* {star:.2f}   exact {exact[site, pos]:.2f}")

# %% [markdown]
# The key's own position (`L0.block_in` at the key) reaches the answer through two softmaxes in a
# row (layer 0's, then layer 1's), and AtP* recomputes the first only: rank the cells by the
# estimate, then re-run the top ones exactly (`hookmech.patching.verify_top`,
# `hookmech patch --method atp-star --verify-top K`).
#
# ### Distributed alignment search: how many dimensions carry the key?
#
# Patching `L1.block_in` at the value restores the answer; DAS asks which *subspace* of that
# 64-dimensional activation is enough. From the activation cache, it learns an orthonormal basis
# of K dimensions such that exchanging just those coordinates with the clean run's restores the
# answer, and compares it with a random basis of the same K.

# %%
das = hookmech.das.train(model, cache_path, "L1.block_in", "value", dims=[1, 4], steps=200)
for record in das.records:
    share = "all" if record["attribution"] > 0.95 else "less than half" if record["attribution"] < 0.5 else "more than half"
    print(f"K = {record['dim']}: the learned subspace restores {share} of the answer; "
          f"a random one {round(record['attribution_random'], 2) + 0.0:.2f}")  # + 0.0: no "-0.00"

# %% [markdown]
# Four of the 64 dimensions are enough: layer 0 writes the key into a small subspace at the value.
#
# ### Path patching: through which input does layer 1 read it?
#
# Path patching restores a *sender* along one route to one *receiver*, everything else held at the
# corrupt run. Here the sender is layer 0's head output at the value and the receivers are layer
# 1's queries, keys and values: along `via="head"`, the clean head output reaches the receiver only.

# %%
paths = hookmech.patching.path_patch(model, batch, "L0.mixer.z[0]@value",
                                     ["L1.mixer.q@query", "L1.mixer.k@value", "L1.mixer.v@value"], via="head")
for record in paths:
    print(f"{record['sender']} -> {record['receiver']:17s} attribution {record['attribution']:.2f}")

# %% [markdown]
# Layer 1 reads the stored key through its **keys** at the value: the query finds the matching
# key there and attends to it, the induction head's lookup; its queries and values do not carry it.
#
# ### The view page
#
# `hookmech view --ckpt M -o page.html` (or these two calls) writes one self-contained HTML page to
# open in any browser: the heatmap, each cell's examples, the effective attention of each layer
# and the induction scores.

# %%
page = hookmech.view.write_page(hookmech.view.checkpoint_page_data(model, task, batch), tmp / "attention.html",
                                "attention_ar_cpu on AR")
print("wrote", page.name, "- open it in a browser")

# %% [markdown]
# ## Where next
#
# - The command line does all of this on your own checkpoints: `hookmech train`, `hookmech cache`,
#   `hookmech patch --site 'L*.block_in' --pos key,value,query --csv -o heatmap.png`, `hookmech das`,
#   `hookmech probe`, `hookmech view`; `hookmech demo` is sections 5–6 in one command.
# - Inside-the-mixer sites (`L1.mixer.q`, Mamba's `L0.mixer.conv` …), heads (`L1.mixer.z[0]`),
#   noising, ablations, other metrics and attribution patching: see the user guide.
# - Sweeps over architectures and learning rates, and the paper's figures: `hookmech sweep`,
#   `hookmech report`.
