"""ShardLayout: the description of where a rank's local parameter sits in the full (TP=1) parameter."""
import pytest
import torch

from te_parallel.parallel.sharding import ShardLayout, replicated, shard_layouts, split_layout


def _assemble(full_shape, layouts, locals_):
    """The full tensor put together from every rank's local tensor through its layout's global_slices."""
    full = torch.full(full_shape, float("nan"))
    for layout, local in zip(layouts, locals_):
        for loc, index in layout.global_slices():
            part = local if layout.dim is None else local.narrow(layout.dim, loc.start, loc.stop - loc.start)
            full[index] = part
    return full


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_even_split_round_trip(dim, tp):
    full = torch.arange(8 * 12, dtype=torch.float32).view(8, 12)
    layouts = [split_layout(full.shape, dim, r, tp) for r in range(tp)]
    shards = full.chunk(tp, dim)
    for layout, shard in zip(layouts, shards):
        assert layout.local_shape == tuple(shard.shape)
    assert torch.equal(_assemble(full.shape, layouts, shards), full)


def test_gated_blocks_are_two_pieces():
    """LayerNormMLP's gated fc1 under TP: rank r holds [a_r; b_r]."""
    ffn, hidden, tp = 8, 3, 2
    full = torch.arange(2 * ffn * hidden, dtype=torch.float32).view(2 * ffn, hidden)
    a, b = full.chunk(2, 0)
    layouts = [split_layout(full.shape, 0, r, tp, blocks=[ffn, ffn]) for r in range(tp)]
    shards = [torch.cat([a.chunk(tp, 0)[r], b.chunk(tp, 0)[r]]) for r in range(tp)]
    assert layouts[1].pieces == ((0, 4, 4), (4, 12, 4))
    assert layouts[1].global_slices()[1] == (slice(4, 8), (slice(12, 16), slice(0, 3)))
    assert torch.equal(_assemble(full.shape, layouts, shards), full)


def test_replicated():
    layout = replicated((5,))
    assert layout.dim is None and layout.pieces == () and layout.local_shape == (5,)
    assert layout.global_slices() == [(slice(None), (slice(0, 5),))]


@pytest.mark.parametrize("kwargs, message", [
    (dict(full_shape=(4, 4), dim=2, pieces=((0, 0, 2),)), "not a dim"),
    (dict(full_shape=(4, 4), dim=0, pieces=((1, 0, 2),)), "in order from 0"),
    (dict(full_shape=(4, 4), dim=0, pieces=((0, 3, 2),)), "outside the full extent"),
    (dict(full_shape=(4, 4), dim=0, pieces=((0, 0, 2), (2, 1, 2))), "overlap"),
    (dict(full_shape=(4, 4), dim=0, pieces=()), "at least one piece"),
    (dict(full_shape=(4, 4), dim=None, pieces=((0, 0, 4),)), "no pieces"),
])
def test_bad_layouts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ShardLayout(**kwargs)


def test_split_layout_errors():
    with pytest.raises(ValueError, match="not divisible by tp_size=4"):
        split_layout((6, 2), 0, 0, 4)
    with pytest.raises(ValueError, match="add up to"):
        split_layout((6, 2), 0, 0, 2, blocks=[2, 2])


def test_shard_layouts_walks_the_tree():
    class Sharded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(2, 3))
            self.b = torch.nn.Parameter(torch.zeros(3))

        def tp_shard_layouts(self):
            return {"w": split_layout((4, 3), 0, 1, 2)}

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), Sharded())
    got = shard_layouts(model)
    assert set(got) == {"0.weight", "0.bias", "1.w", "1.b"}
    assert got["1.w"].pieces == ((0, 2, 2),) and got["1.b"].is_replicated and got["0.weight"].full_shape == (3, 3)
    model[1].tp_shard_layouts = lambda: {"w": split_layout((6, 3), 0, 1, 2)}
    with pytest.raises(ValueError, match=r"1.w has shape \(2, 3\) but its layout describes a local shape \(3, 3\)"):
        shard_layouts(model)
    model[1].tp_shard_layouts = lambda: {"nope": replicated((1,))}
    with pytest.raises(ValueError, match="'nope', which is not one of its own parameters"):
        shard_layouts(model)
