"""A TransformerLens user's everyday calls on hookmech models (docs/guide.md, "TransformerLens's
idioms"), each on the bundled attention fixture and on the Mamba fixture: the loss
(``return_type="loss"``/``"both"``, ``loss_per_token``), gradients in the cache
(``run_with_cache(incl_bwd=True)``), the weights by TransformerLens's names (W_Q ... OV, W_in ...),
``blocks[l].attn`` with TransformerLens's `SVDInterpreter` and head detector, ``to_tokens`` and
``to_string``, and the refusals where a model lacks the part.

Each is compared with a computation written here from the model's parameters and hooks: a
cross-entropy by hand, autograd's gradient of a hooked activation, q/k/v/z and the mixer output
from the weights, an SVD, the detector's score from the pattern. The models are float64 copies, so
that a hand computation and the model's (the same float64 terms summed in two orders) agree to
FLOAT64_SUM_TOL.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from transformer_lens import SVDInterpreter
from transformer_lens import patching as tl_patching

import hookmech
from hookmech.errors import NoComponentError, UsageError
from hookmech.mixers.capabilities import MissingCapability
from hookmech.patching import patch
from hookmech.tl_compat import block_every_parts, detect_head, get_act_patch_block_every

from helpers import ENGINE_TOL, FLOAT64_SUM_TOL, REPO, make_model

FIXTURES = {name: REPO / "fixtures" / f"{name}.safetensors" for name in ("attention_ar_paper", "mamba_ar_cpu")}


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=FLOAT64_SUM_TOL)


def one_line_refusal(error: Exception, *phrases: str) -> None:
    message = str(error)
    assert "\n" not in message and all(phrase in message for phrase in phrases), message


@pytest.fixture(scope="module", params=sorted(FIXTURES))
def fixture(request):
    """(name, float64 model, batch of 4 rows) of a bundled fixture."""
    path = FIXTURES[request.param]
    model, task = hookmech.load(path).double().eval(), hookmech.tasks.from_checkpoint(path)
    model.set_vocabulary(task)  # to_tokens / to_string: the task's token names
    return request.param, model, task.sample(4, seed=1)


# -- the loss -------------------------------------------------------------------------------------
def test_loss_is_the_cross_entropy_of_each_next_token(fixture):
    _, model, batch = fixture
    tokens = batch.tokens
    logits = model(tokens)
    log_probs = logits.log_softmax(-1)
    by_hand = -log_probs[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]  # [batch, pos - 1]
    close(model(tokens, return_type="loss"), by_hand.mean())
    close(model(tokens, return_type="loss"), F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()))
    close(model(tokens, return_type="loss", loss_per_token=True), by_hand)
    both_logits, both_loss = model(tokens, return_type="both")
    close(both_logits, logits)
    close(both_loss, by_hand.mean())
    assert model(tokens, return_type=None) is None


def test_a_loss_without_tokens_or_every_positions_logits_is_refused(fixture):
    _, model, batch = fixture
    with pytest.raises(UsageError) as refused:
        model(batch.tokens, return_type="loss", positions=batch.query_pos)
    one_line_refusal(refused.value, "return_type='loss'", "positions")
    with pytest.raises(UsageError) as refused:
        model(batch.tokens, return_type="probs")
    one_line_refusal(refused.value, "return_type must be one of", "'probs'")


# -- gradients in the cache --------------------------------------------------------------------
def gradients_by_autograd(model, tokens, hooks: list[str]) -> dict[str, torch.Tensor]:
    """The gradient of the mean loss with respect to each hook's activation: autograd on tensors
    kept by forward hooks (no backward hook)."""
    kept = {}

    def keep(activation, hook):
        activation.retain_grad()
        kept[hook.name] = activation

    loss = model.run_with_hooks(tokens, return_type="loss", fwd_hooks=[(name, keep) for name in hooks])
    loss.backward()
    model.zero_grad()
    return {name: kept[name].grad for name in hooks}


def test_run_with_cache_incl_bwd_keeps_each_hooks_gradient_under_transformer_lens_names(fixture):
    name, model, batch = fixture
    inside = "blocks.0.mixer.hook_pattern" if name.startswith("attention") else "blocks.0.mixer.hook_ssm_state"
    hooks = ["hook_embed", "blocks.0.hook_resid_pre", inside, "blocks.1.hook_mixer_out", "ln_final.hook_normalized"]
    expected = gradients_by_autograd(model, batch.tokens, hooks)
    loss, cache = model.run_with_cache(batch.tokens, return_type="loss", incl_bwd=True)
    model.zero_grad()
    close(loss, model(batch.tokens, return_type="loss"))
    for hook in hooks:
        close(cache[hook + "_grad"], expected[hook])
        assert cache[hook].shape == cache[hook + "_grad"].shape
    # TransformerLens's names of a hook's gradient: an alias's, and the shorthand's
    close(cache["blocks.1.hook_attn_out_grad"], expected["blocks.1.hook_mixer_out"])
    assert expected["blocks.1.hook_mixer_out"].abs().max() > 0


def test_incl_bwd_without_a_scalar_loss_is_refused(fixture):
    _, model, batch = fixture
    for options in ({}, {"return_type": "logits"}, {"return_type": "loss", "loss_per_token": True}):
        with pytest.raises(UsageError) as refused:
            model.run_with_cache(batch.tokens, incl_bwd=True, **options)
        one_line_refusal(refused.value, "incl_bwd=True", "return_type='loss'")


# -- weights by TransformerLens's names ------------------------------------------------------------
def test_attention_weights_reproduce_q_k_v_z_and_the_mixer_output(fixture):
    name, model, batch = fixture
    if not name.startswith("attention"):
        for weight in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_O", "QK", "OV"):
            with pytest.raises(NoComponentError) as refused:
                getattr(model, weight)
            one_line_refusal(refused.value, "block 0's mixer (Mamba) has no attention weights")
        return
    assert_attention_weights(model, batch.tokens)


def assert_attention_weights(model, tokens) -> None:
    _, cache = model.run_with_cache(tokens)
    n_layers, (n_heads, d_head), d_model = model.cfg.n_layers, model.cfg.head_shape(0), model.cfg.d_model
    assert model.W_Q.shape == (n_layers, n_heads, d_model, d_head) and model.W_O.shape == (n_layers, n_heads, d_head, d_model)
    assert model.b_Q.shape == (n_layers, n_heads, d_head) and model.b_O.shape == (n_layers, d_model)
    for layer in range(n_layers):
        attn, x = model.blocks[layer].attn, cache[f"blocks.{layer}.hook_mixer_in"]
        assert attn is model.blocks[layer].mixer
        for letter in "qkv":
            weight, bias = getattr(attn, f"W_{letter.upper()}"), getattr(attn, f"b_{letter.upper()}")
            close(torch.einsum("bpm,hmd->bphd", x, weight) + bias, cache[f"blocks.{layer}.attn.hook_{letter}"])
            close(getattr(model, f"W_{letter.upper()}")[layer], weight)
        z = cache[f"blocks.{layer}.attn.hook_z"]
        close(torch.einsum("bphd,hdm->bpm", z, attn.W_O) + attn.b_O, cache[f"blocks.{layer}.hook_attn_out"])
        close(model.OV[layer].AB, attn.W_V @ attn.W_O)
        close(model.QK[layer].AB, attn.W_Q @ attn.W_K.transpose(-2, -1))
        # the scores are q·k/√d_head, so QK is what the bias-free scores read of two positions' inputs
        scores = torch.einsum("bqhd,bkhd->bhqk", cache[f"blocks.{layer}.attn.hook_q"], cache[f"blocks.{layer}.attn.hook_k"])
        finite = cache[f"blocks.{layer}.attn.hook_attn_scores"].isfinite()
        close(cache[f"blocks.{layer}.attn.hook_attn_scores"][finite], (scores / d_head**0.5)[finite])


def test_attention_weights_of_several_heads_with_biases_and_their_refusal_after_a_convolution(ar_task):
    model = make_model(ar_task, mixers="attention", d_model=16, layer_options=[{"n_heads": 4}, {"n_heads": 2}])
    with torch.no_grad():
        for param in model.parameters():  # biases away from their zero init, so that each takes part
            param.add_(0.1 * torch.randn_like(param))
    model = model.double()
    tokens = ar_task.sample(3, seed=2).tokens
    for layer, n_heads in enumerate((4, 2)):
        assert model.blocks[layer].attn.W_Q.shape == (n_heads, 16, 16 // n_heads)
    with pytest.raises(NoComponentError) as refused:  # heads differ between the layers: no stack
        model.W_Q
    one_line_refusal(refused.value, "do not stack", "blocks[l].attn.W_Q")
    uniform = make_model(ar_task, mixers="attention", d_model=16, layer_options=[{"n_heads": 4}] * 2)
    with torch.no_grad():
        for param in uniform.parameters():
            param.add_(0.1 * torch.randn_like(param))
    assert_attention_weights(uniform.double(), tokens)
    convolved = make_model(ar_task, mixers="attention", d_model=16, layer_options=[{"qkv_conv": "k"}] * 2)
    with pytest.raises(NoComponentError) as refused:
        convolved.W_K
    one_line_refusal(refused.value, "W_K", "qkv_conv 'k'")
    assert convolved.W_Q.shape == (2, 1, 16, 16)  # q has no convolution


def test_mlp_weights_reproduce_the_neurons_and_the_mlp_output(fixture):
    name, model, batch = fixture
    if name.startswith("mamba"):
        for weight in ("W_in", "b_in", "W_out", "b_out"):
            with pytest.raises(NoComponentError) as refused:
                getattr(model, weight)
            one_line_refusal(refused.value, "block 0 (mamba) has no MLP")
        return
    _, cache = model.run_with_cache(batch.tokens)
    assert model.W_in.shape == (model.cfg.n_layers, model.cfg.d_model, model.cfg.d_mlp)
    for layer in range(model.cfg.n_layers):
        pre = cache[f"blocks.{layer}.hook_mlp_in"] @ model.W_in[layer] + model.b_in[layer]
        close(F.gelu(pre), cache[f"blocks.{layer}.mlp.hook_post"])
        close(F.gelu(pre) @ model.W_out[layer] + model.b_out[layer], cache[f"blocks.{layer}.hook_mlp_out"])


def test_blocks_attn_exists_only_where_the_mixer_has_attention_weights(fixture):
    name, model, _ = fixture
    block = model.blocks[0]
    if name.startswith("attention"):
        assert block.attn is block.mixer and "attn" not in dict(block.named_children())
        assert not any(".attn." in key for key in model.state_dict())  # saved once, as the mixer
        return
    assert getattr(block, "attn", None) is None
    with pytest.raises(MissingCapability) as refused:
        block.attn
    one_line_refusal(refused.value, "blocks[0].attn", "(Mamba) has no attention weights", "blocks.0.hook_mixer_out")


# -- TransformerLens's tools that read the weights ---------------------------------------------------
def aligned(vectors: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """`vectors` ``[d_vocab, 1, k]`` with each column's sign flipped to agree with `reference`'s
    (a singular vector is defined up to its sign)."""
    signs = torch.sign((vectors * reference).sum(dim=(0, 1), keepdim=True))
    return vectors * signs


def test_svd_interpreter_reads_the_ov_circuit_and_the_mlp_weights(fixture):
    name, model, _ = fixture
    interpreter = SVDInterpreter(model)
    if name.startswith("mamba"):
        with pytest.raises(KeyError):  # TransformerLens's own lookup: the model has no attention weights
            interpreter.get_singular_vectors("OV", layer_index=0, head_index=0, num_vectors=3)
        return
    for layer in range(model.cfg.n_layers):
        ov = model.W_V[layer, 0] @ model.W_O[layer, 0]  # [d_model, d_model]
        _, _, right = torch.linalg.svd(ov)
        expected = (model.W_U.T @ right[:3].T)[:, None, :]  # top right singular vectors read by the unembedding
        found = interpreter.get_singular_vectors("OV", layer_index=layer, head_index=0, num_vectors=3)
        torch.testing.assert_close(aligned(found, expected), expected, rtol=0, atol=1e-8)
        w_in = model.W_in[layer].T * model.blocks[layer].ln2.weight  # TL multiplies the unfolded ln2 weight in
        _, _, right = torch.linalg.svd(w_in)
        expected = (model.W_U.T @ right[:3].T)[:, None, :]
        found = interpreter.get_singular_vectors("w_in", layer_index=layer, num_vectors=3)
        torch.testing.assert_close(aligned(found, expected), expected, rtol=0, atol=1e-8)


def test_detect_head_scores_each_heads_attention_to_the_previous_token(fixture):
    name, model, batch = fixture
    n_pos = min(12, model.cfg.n_ctx - 1)  # TransformerLens's detector takes fewer than n_ctx tokens
    text = model.to_string(batch.tokens[0, :n_pos])
    if name.startswith("mamba"):
        with pytest.raises(NoComponentError) as refused:  # a Mamba block has no attention pattern
            detect_head(model, text, "previous_token_head")
        one_line_refusal(refused.value, "blocks.0.attn.hook_pattern", "(mamba) has no such hook")
        return
    scores = detect_head(model, text, "previous_token_head")
    _, cache = model.run_with_cache(batch.tokens[:1, :n_pos])
    previous = torch.diag(torch.ones(n_pos - 1, dtype=torch.float64), -1)  # query t attends key t - 1
    assert scores.shape == (model.cfg.n_layers, model.cfg.n_heads)
    for layer in range(model.cfg.n_layers):
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"][0]  # [head, query, key]
        by_hand = (pattern * previous).sum(dim=(1, 2)) / pattern.sum(dim=(1, 2))
        torch.testing.assert_close(scores[layer].double(), by_hand, rtol=0, atol=1e-6)  # TL's scores are float32
    # the paper's fixture: layer 0 is a window-2 head, attending mostly the previous token
    assert scores[0, 0] > 0.3


# -- text --------------------------------------------------------------------------------------------
def test_to_tokens_and_to_string_speak_the_tasks_token_names(fixture):
    name, model, batch = fixture
    task = hookmech.tasks.from_checkpoint(FIXTURES[name])
    row = batch.tokens[0]
    text = task.describe_tokens(row.tolist())  # "BOS k3 v0 ... DIV k3"
    assert model.to_string(row) == text and model.to_string(batch.tokens[:2]) == [
        task.describe_tokens(r.tolist()) for r in batch.tokens[:2]
    ]
    assert torch.equal(model.to_tokens(text), row[None]) and model.to_tokens(text).dtype == torch.int64
    assert torch.equal(model.to_tokens([text, text]), row[None].expand(2, -1))
    names = task.token_names(model.cfg.d_vocab)
    assert model.to_str_tokens(row) == [names[i] for i in row.tolist()] == model.to_str_tokens(text)
    assert torch.equal(model.to_tokens(text.removeprefix("BOS "), prepend_bos=True), row[None])
    with pytest.raises(UsageError) as refused:
        model.to_tokens("BOS k1 vx7")
    one_line_refusal(refused.value, "'vx7' is no token of this model's task")
    with pytest.raises(UsageError) as refused:
        model.to_tokens(["BOS k1", "BOS"])
    one_line_refusal(refused.value, "one token count each")


def test_a_model_without_a_vocabulary_says_how_to_give_it_one(ar_task):
    model = make_model(ar_task)
    with pytest.raises(UsageError) as refused:
        model.to_tokens("BOS k1")
    one_line_refusal(refused.value, "no vocabulary", "set_vocabulary", "from_checkpoint")
    model.set_vocabulary(ar_task)
    row = ar_task.sample(1, seed=0).tokens
    assert torch.equal(model.to_tokens(model.to_string(row[0])), row)


# -- what a model lacks, refused by TransformerLens's names ------------------------------------------
def test_apply_ln_to_stack_at_a_block_is_that_blocks_own_norm(fixture):
    """A Mamba block's RMSNorm under a final LayerNorm: TransformerLens would centre it as the
    final norm's kind; each norm answers for itself here (the block's norm, less its weight)."""
    _, model, batch = fixture
    _, cache = model.run_with_cache(batch.tokens)
    for layer in range(model.cfg.n_layers):
        block = model.blocks[layer]
        resid = cache[f"blocks.{layer}.hook_resid_pre"]
        normed = cache.apply_ln_to_stack(resid[None], layer=layer)[0]
        close(normed * block.ln1.weight + getattr(block.ln1, "bias", 0), cache[f"blocks.{layer}.hook_mixer_in"])
        by_hand = resid - resid.mean(-1, keepdim=True) if isinstance(block.ln1, torch.nn.LayerNorm) else resid
        scale = (by_hand.pow(2).mean(-1, keepdim=True) + block.ln1.eps).sqrt()
        close(normed, by_hand / scale)


def test_block_every_sweeps_the_parts_the_model_has(fixture):
    name, model, batch = fixture
    model = model.float()
    rows = torch.arange(len(batch))

    def p_answer(logits):
        return logits[rows, batch.query_pos].softmax(-1)[rows, batch.answers].double().mean()

    _, clean = model.run_with_cache(batch.tokens)
    with torch.no_grad():
        grid = get_act_patch_block_every(model, batch.corrupt_tokens, clean, p_answer).double()
    parts = block_every_parts(model)
    assert parts == (("resid_pre", "attn_out") if name.startswith("mamba") else ("resid_pre", "attn_out", "mlp_out"))
    assert grid.shape == (len(parts), model.cfg.n_layers, batch.tokens.shape[1])
    sites = {"resid_pre": "block_in", "attn_out": "mixer_out", "mlp_out": "mlp_out"}
    for index, part in enumerate(parts):  # the patching engine, site by site
        records = patch(model, batch, [f"L*.{sites[part]}"], ["all"])
        engine = torch.tensor([r["p_patched"] for r in records], dtype=torch.float64).view(grid.shape[1:])
        torch.testing.assert_close(grid[index], engine, rtol=0, atol=ENGINE_TOL)
    if name.startswith("mamba"):  # TransformerLens's own still refuses the missing MLP, in one line
        with pytest.raises(NoComponentError) as refused, torch.no_grad():
            tl_patching.get_act_patch_block_every(model, batch.corrupt_tokens, clean, p_answer)
        one_line_refusal(refused.value, "has no MLP", "hookmech.tl_compat.get_act_patch_block_every")
    model.double()


def test_ssm_names_are_refused_where_the_mixer_has_no_such_hook(fixture):
    name, model, batch = fixture
    _, cache = model.run_with_cache(batch.tokens)
    if name.startswith("mamba"):
        assert cache["blocks.0.mixer.hook_ssm_out"] is cache["blocks.0.hook_mixer_out"]
        missing, phrases = "blocks.0.mixer.hook_ssm_dt", ("(mamba)", "blocks.0.mixer.hook_ssm_out")
    else:
        missing, phrases = "blocks.0.mixer.hook_ssm_out", ("(attention)", "no state-space model")
    with pytest.raises(NoComponentError) as refused:
        cache[missing]
    one_line_refusal(refused.value, missing, *phrases)
    assert missing not in cache


def test_head_hooks_of_layers_with_different_head_counts_are_refused(ar_task):
    model = make_model(ar_task, mixers="attention", d_model=16, layer_options=[{"n_heads": 1}, {"n_heads": 2}])
    _, cache = model.run_with_cache(ar_task.sample(3, seed=1).tokens)
    for name in ("blocks.1.attn.hook_z", "blocks.0.attn.hook_pattern"):
        with pytest.raises(NoComponentError) as refused:
            cache[name]
        one_line_refusal(refused.value, name, "[1, 2] heads")
        assert name not in cache
    assert cache["blocks.1.mixer.hook_z"].shape[2] == 2  # hookmech's own name holds every head


def test_a_pretrained_folder_speaks_through_the_tokenizer_beside_its_weights(tmp_path):
    import pretrained_folders

    pretrained_folders.gpt2(tmp_path)
    model = hookmech.from_pretrained(tmp_path)
    reference = pretrained_folders.word_tokenizer()  # transformers' tokenizer of the same words
    text = "w3 w1 w40 w7"
    expected = reference(text, add_special_tokens=False)["input_ids"]
    assert model.to_tokens(text).tolist() == [expected]
    assert model.to_tokens(text, prepend_bos=True).tolist() == [[reference.bos_token_id, *expected]]
    assert model.to_string(torch.tensor(expected)) == reference.decode(expected)
    assert model.to_str_tokens(text) == reference.convert_ids_to_tokens(expected)
    logits = model(model.to_tokens(text))
    assert logits.shape == (1, 4, model.cfg.d_vocab)
