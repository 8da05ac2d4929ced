"""Write docs/sites.md: every hook of the backbone and of every mixer, with shape and meaning.

    python scripts/make_site_reference.py            # rewrite docs/sites.md
    python scripts/make_site_reference.py --check    # exit 1 if docs/sites.md is out of date

Shapes are measured, not typed: each mixer is built with its defaults in a 1-layer HookedLM
(d_model 64, n_ctx 12) and run once on a batch of 1.
"""
from __future__ import annotations

import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "sites.md"
D_MODEL, N_CTX = 64, 12

BLOCK_MEANINGS = {
    "embed": "token embedding",
    "pos_embed": "learned position embedding (models with `pos_emb=learned`)",
    "L0.block_in": "residual stream entering block 0",
    "L0.mixer_in": "input of the sequence mixer (after its norm)",
    "L0.mixer_out": "output of the sequence mixer, before the residual add",
    "L0.resid_mid": "residual after the mixer add (blocks with an MLP)",
    "L0.mlp_in": "input of the MLP (after its norm)",
    "L0.mlp_out": "output of the MLP, before the residual add",
    "L0.block_out": "residual stream leaving block 0",
    "final_norm": "final norm output, the LM head's input",
}

MEANINGS = {
    "attention": {
        "q": "queries (after the optional q convolution)", "k": "keys (after the optional k convolution)",
        "v": "values (after the optional v convolution)", "attn_scores": "q·k/√d_head with the causal/window mask (-inf)",
        "pattern": "softmax of the scores: where each query attends", "z": "attention-weighted values, per head",
    },
    "baseconv": {"proj": "linear branch W u", "conv": "convolution branch (short kernel, or implicit long filter)",
                 "filter": "implicit long-convolution filter (no batch or position axis)"},
    "based": {
        "q": "query projection (feature_dim)", "k": "key projection (feature_dim)", "v": "value projection",
        "phi_q": "Taylor-exp feature map of q: [1, q/d^¼, q⊗q/(√2·√d)]", "phi_k": "Taylor-exp feature map of k",
        "kv_state": "recurrent state Σ φ(k)ᵀv up to each position", "k_state": "normaliser state Σ φ(k)",
        "y": "linear-attention output per head",
    },
    "h3": {
        "q": "query projection per head", "k": "key projection per head", "v": "value projection per head",
        "shift": "shift-SSM output of k (remembers recent keys)", "shift_filter": "shift-SSM kernel (no batch or position axis)",
        "kv": "outer product shift(k)ᵀ v per head", "ssm": "diagonal-SSM output of the kv products",
        "ssm_filter": "diagonal-SSM kernel (no batch or position axis)",
    },
    "hyena": {
        "short_conv": "in-projection after the short (3) convolution: x1, x2, v stacked", "x1": "first gate",
        "x2": "second gate", "v": "value branch", "filter": "implicit long filter (no batch or position axis)",
        "long_conv": "long convolution of x2·v", "y": "gated output x1·long_conv",
    },
    "mamba": {
        "in_x": "x branch of in_proj", "gate": "z branch of in_proj (SiLU gate)", "conv": "short causal convolution of x",
        "conv_act": "SiLU(conv): the SSM input u", "delta": "Δ = softplus(dt_proj(·)) per channel", "B": "input matrix B_t",
        "C": "output matrix C_t", "ssm_state": "h_t = exp(ΔA) h_{t-1} + Δ B u (after position t); patching propagates",
        "y": "SSM output before the gate (includes D·u)",
    },
    "mamba2": {
        "in_x": "x branch of in_proj", "gate": "z branch (gated RMSNorm)", "conv": "short convolution over x, B, C",
        "conv_act": "SiLU(conv) x per head", "delta": "dt per head (after softplus)", "B": "B_t per group", "C": "C_t per group",
        "ssm_state": "h_t = exp(dt·A) h_{t-1} + dt x Bᵀ per head (after position t); patching propagates",
        "y": "SSD output per head (includes D·x)",
    },
    "deltanet": {
        "q": "queries (short conv, SiLU, L2-normalised)", "k": "keys (short conv, SiLU, L2-normalised)",
        "v": "values (short conv, SiLU)", "beta": "writing strength β = sigmoid(W x) per head",
        "state": "S_t = S_{t-1} − β_t (S_{t-1} k_t − v_t) k_tᵀ (after position t); patching propagates",
        "y": "output S_t q_t per head",
    },
    "rwkv": {
        "r": "receptance", "k": "key", "v": "value", "decay": "raw data-dependent decay w_t (factor exp(−exp(w)))",
        "gate": "output gate g, after its SiLU", "state": "wkv state S_t = diag(decay) S_{t-1} + k_tᵀ v_t; patching propagates",
        "output": "r·(S_{t-1} + diag(u) kᵀv) per head, before group norm",
    },
}


#: TransformerLens's SSM names, per mixer: which hookmech hook means the same (aliased) and which not
TL_SSM_NOTES = {
    "mamba": (
        "TransformerLens's Mamba bridge: its `mixer.hook_ssm_out` is the block's `hook_mixer_out` (an alias above). "
        "Its `mixer.hook_ssm_state` shares this mixer's name, not its axes or its patch: TransformerLens's is "
        "[batch, d_inner, pos, d_state] (position axis 2), fires only on its eager-scan path, and a patch there "
        "changes that position's read-out only; hookmech's propagates through the recurrence. Its `hook_ssm_dt` "
        "(dt_proj's output, before the softplus of `delta`), `hook_in_proj`, `hook_conv` (channel-first, "
        "untruncated), `hook_x_proj` and `hook_ssm_write` (Δ·B·x) mean nothing a hookmech hook holds: no alias."
    ),
    "mamba2": (
        "TransformerLens's Mamba-2 bridge: its `mixer.hook_ssm_out` is the block's `hook_mixer_out` (an alias "
        "above); its `mixer.hook_ssm_state` is this mixer's, with the same axes [batch, pos, head, headdim, "
        "d_state] (TransformerLens fires it only on its eager-scan path, where a patch changes that position's "
        "read-out only; hookmech's propagates). Its `hook_in_proj`, `hook_conv` (over x, B, C, channel-first), "
        "`hook_inner_norm` (the gated norm's output) and `hook_ssm_write` have no hookmech hook: no alias."
    ),
    "deltanet": (
        "TransformerLens's GatedDeltaNet bridge names q, k and β `hook_ssm_C`, `hook_ssm_B` and `hook_ssm_write`, "
        "on a gated variant at `blocks.{l}.linear_attn`, whose `hook_ssm_state` is [batch, pos, head, d_head_k, "
        "d_head_v] (this mixer's `state` transposed): not aliased."
    ),
}


def _table(rows, meanings, strip_prefix):
    lines = ["| site | hook | shape | axes | pos axis | meaning |", "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        short = row["site"].replace(strip_prefix, "") if strip_prefix else row["site"]
        if short not in meanings:
            raise SystemExit(f"no meaning written for {row['site']} — add it to {__file__}")
        shape = "[" + ", ".join(map(str, row["shape"])) + "]"
        pos = "—" if row["pos_axis"] is None else str(row["pos_axis"])
        lines.append(f"| `{row['site']}` | `{row['hook']}` | {shape} | {row['axes']} | {pos} | {meanings[short]} |")
    return lines


def render() -> str:
    """Return the Markdown of docs/sites.md."""
    from hookmech.config import build_config
    from hookmech.mixers import REGISTRY
    from hookmech.model import HookedLM
    from hookmech.sites import list_sites

    out = [
        "# Site reference",
        "",
        "Generated by `python scripts/make_site_reference.py` (a test checks it is current). Shapes are measured on",
        f"a batch of 1 sequence of {N_CTX} tokens with d_model {D_MODEL} and each mixer's defaults; `pos axis` is the",
        "axis patched when a position is given (— : the hook has no position axis and cannot be patched at a position).",
        "Sites of layer 0 are shown; every layer has the same.",
        "",
        "## Backbone",
        "",
    ]
    model = HookedLM(build_config(d_vocab=20, n_ctx=N_CTX, mixers="attention", d_model=D_MODEL, n_layers=1))
    rows = [r for r in list_sites(model) if ".mixer." not in r["site"]]
    out += _table(rows, BLOCK_MEANINGS, "")
    out += ["", "Blocks without an MLP (mamba, mamba2) have no `resid_mid`, `mlp_in`, `mlp_out`.", ""]
    out += [
        "**TransformerLens's names.** Every block also answers to TransformerLens's `blocks.{l}.hook_attn_out`",
        "(its `hook_mixer_out`: TransformerLens's attention sublayer is the block's mixer, whatever it is); each",
        "mixer below lists its other TransformerLens names. They are aliases: `run_with_hooks`, `hooks` and caches",
        "take them, but they are no hooks of their own (not in `model.hook_dict`, site lists or cache files). What",
        "TransformerLens's ActivationCache reads but no hook holds is computed from the cached hooks on each read",
        "(`HookedLM.derived_activation`): `ln_final.hook_scale` and `blocks.{l}.ln1.hook_scale`, `ln2.hook_scale`",
        "(the norm's divisor), `blocks.{l}.attn.hook_result` (each head's write into the residual stream) and",
        "`blocks.{l}.mlp.hook_post` (the MLP's neurons).",
        "",
    ]
    for name in sorted(REGISTRY):
        cls = REGISTRY[name]
        model = HookedLM(build_config(d_vocab=20, n_ctx=N_CTX, mixers=name, d_model=D_MODEL, n_layers=1))
        rows = [r for r in list_sites(model) if ".mixer." in r["site"]]
        summary = (cls.__doc__ or "").strip().splitlines()[0]
        out += [f"## `{name}` — {cls.__module__}.{cls.__name__}", "", summary, ""]
        out += _table(rows, MEANINGS.get(name, {}), "L0.mixer.")
        aliases = ", ".join(f"`{alias}` = `{hook}`" for alias, hook in model.hook_aliases.items())
        out += ["", f"TransformerLens's names: {aliases}."]
        if name in TL_SSM_NOTES:
            out += ["", TL_SSM_NOTES[name]]
        out.append("")
    return "\n".join(out)


def main() -> None:
    text = render()
    if "--check" in sys.argv:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is out of date: run python scripts/make_site_reference.py", file=sys.stderr)
            sys.exit(1)
        return
    DOC.write_text(text)


if __name__ == "__main__":
    main()
