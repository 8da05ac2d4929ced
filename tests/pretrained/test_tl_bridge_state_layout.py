"""hookmech's ``blocks.{l}.mixer.hook_ssm_state`` against TransformerLens's own Mamba bridges on the
same weights (docs/guide.md, "TransformerLens's idioms"): the name is shared, the layout is
TransformerLens's for Mamba-2 ``[batch, pos, head, headdim, d_state]`` and its transpose for Mamba-1
(TransformerLens's ``[batch, d_inner, pos, d_state]``, hookmech's ``[batch, pos, d_inner, d_state]``,
position axis 1 as every hookmech state hook). TransformerLens fires the hook on its eager scan only."""
from __future__ import annotations

import pytest
import torch

from ssm_folders import PARITY_TOL, load, mamba2_folder, mamba_folder

transformers = pytest.importorskip("transformers")


@pytest.mark.slow  # importing TransformerLens's bridges costs ~5 s of CPU
@pytest.mark.parametrize("make_folder,axes", [
    (mamba_folder, "batch pos d_inner d_state"),
    (mamba2_folder, "batch pos head headdim d_state"),
])
def test_ssm_state_is_transformer_lens_bridges_state_in_hookmechs_layout(tmp_path, make_folder, axes):
    from transformer_lens.model_bridge import TransformerBridge

    folder, hf_model = make_folder(tmp_path)
    bridge = TransformerBridge.boot_transformers(str(folder), hf_model=hf_model)
    for block in bridge.blocks:
        block.mixer.eager_scan = True  # TransformerLens's hook_ssm_state fires on its eager scan only
    ours = load(folder)
    tokens = torch.tensor([[1, 5, 7, 3, 9, 2, 11, 4, 8, 6]])
    _, theirs_cache = bridge.run_with_cache(tokens)
    _, our_cache = ours.run_with_cache(tokens)
    for layer in range(ours.cfg.n_layers):
        name = f"blocks.{layer}.mixer.hook_ssm_state"
        theirs, state = theirs_cache[name], our_cache[name]
        assert ours.hook_dict[name].axes == axes and ours.hook_dict[name].pos_axis == 1
        if axes.startswith("batch pos d_inner"):  # Mamba-1: TransformerLens puts the position third
            theirs = theirs.transpose(1, 2)
        assert state.shape == theirs.shape
        torch.testing.assert_close(state, theirs.to(state.dtype), rtol=0, atol=PARITY_TOL)
