"""Width pruning of attention (`kava_ray.core.prune`, Minitron): keeping every group changes nothing; a pruned
layer computes exactly what the full one computes with the dropped heads' outputs zeroed; the most active group is
the one kept; the result saves and reloads with the new KV geometry."""

from __future__ import annotations

import pytest
import torch

from kava_ray.core.models import decoder_layers, kv_geometry, load_model
from kava_ray.core.prune import kv_group_importance, prune_kv_groups
from kava_ray.testing.tiny import build_tiny_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    """A 2-layer tiny model of 4 query heads over 2 KV heads (2 groups of 2), and a batch with padding."""
    path = build_tiny_model(tmp_path_factory.mktemp(request.param) / "m", family=request.param, num_layers=2,
                            hidden_size=64, num_heads=4, num_kv_heads=2, seed=3)
    ids = torch.randint(5, 200, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return path, ids, mask


def test_keeping_every_group_changes_nothing(tiny):
    path, ids, mask = tiny
    full, pruned = load_model(path, dtype="float32"), load_model(path, dtype="float32")
    imp = kv_group_importance(pruned, ids, mask)
    assert imp.shape == (2, 2) and (imp > 0).all()
    assert prune_kv_groups(pruned, 2, imp) == [[0, 1], [0, 1]]
    with torch.no_grad():
        torch.testing.assert_close(pruned(input_ids=ids, attention_mask=mask).logits,
                                   full(input_ids=ids, attention_mask=mask).logits)


def test_a_pruned_layer_is_the_full_one_with_the_dropped_heads_zeroed(tiny, tmp_path):
    """Group 1 of layer 0 made the most active (its value rows x 10): it is the one kept at n 1; the pruned attention
    block equals the full one whose o_proj reads zeros for the dropped group's heads (to float rounding); saved and
    reloaded, the model has 1 KV head x 16 and its KV has that geometry."""
    path, ids, mask = tiny
    full = load_model(path, dtype="float32")
    attn = decoder_layers(full)[0].self_attn
    with torch.no_grad():
        attn.v_proj.weight[16:] *= 10  # group 1's KV head (head_dim 16)
    pruned = load_model(path, dtype="float32")
    pruned.load_state_dict(full.state_dict())
    kept = prune_kv_groups(pruned, 1, kv_group_importance(pruned, ids, mask))
    assert kept[0] == [1]
    h = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(7)[None].expand(2, -1)
    rope = full.model.rotary_emb(h, pos)

    def block(model, zero_first_group: bool):
        a = decoder_layers(model)[0].self_attn
        if zero_first_group:  # o_proj reads zeros for query heads 0, 1 (group 0)
            handle = a.o_proj.register_forward_pre_hook(lambda m, args: (torch.cat([torch.zeros_like(
                args[0][..., :32]), args[0][..., 32:]], -1),))
        out = a(h, position_embeddings=rope, attention_mask=None)[0]
        if zero_first_group:
            handle.remove()
        return out

    with torch.no_grad():
        torch.testing.assert_close(block(pruned, False), block(full, True), rtol=1e-5, atol=1e-6)
    pruned.save_pretrained(tmp_path / "p")
    again = load_model(tmp_path / "p", dtype="float32")
    g = kv_geometry(again.config)
    assert (g.num_kv_heads, g.head_dim, again.config.num_attention_heads) == (1, 16, 2)
    with torch.no_grad():
        out = again(input_ids=ids, attention_mask=mask, use_cache=True)
    assert tuple(out.past_key_values.layers[0].keys.shape) == (3, 1, 12, 16)


def test_pruning_more_groups_than_there_are_is_one_line(tiny):
    path, ids, mask = tiny
    model = load_model(path, dtype="float32")
    with pytest.raises(Exception, match="keep between 1 and 2 KV groups, not 3"):
        prune_kv_groups(model, 3, torch.ones(2, 2))
