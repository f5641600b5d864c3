"""FP8 weight parameters under Float8BlockScaling: GEMM weights held as FP8 bytes in 128x128 blocks (or
1x128 tiles, w_block_scaling_dim=1) with one scale_inv per block.

References: the bytes and scales are those of `quantize_blockwise_reference` (torch, the kernels'
reference) of the value written, bit for bit. A module with FP8 weights computes exactly what the same
module computes with high-precision weights holding the dequantized values (its forward casts them to
the same values: power-of-two scales make the re-cast exact), outputs and every gradient torch.equal;
with 128x128 blocks it also trains exactly as the module whose fp32 weights are the masters. What FSDP2
does to a parameter (chunk, pad, the all-gather hooks) is simulated here on one process; the gloo run is
tests/distributed/test_fsdp2_block_weights.py.
"""
import copy
import io
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import te_parallel as te
from te_parallel import recipe as R
from te_parallel.fp8.blockwise import BlockwiseTensor, quantize_blockwise_reference
from te_parallel.fp8.params import Float8Weight, MasterWeights, write_fp8_weights
from te_parallel.ops.fp8_weight import cat_fp8_weights, weight_operand
from tests.test_fp8_params import assert_same_step

E4M3 = torch.float8_e4m3fn
DIMS = {"128x128": 2, "1x128": 1}
MODULES = {
    "Linear": (te.Linear, (256, 384), {}, (32, 256)),
    "Linear-split": (te.Linear, (256, 384), dict(parameters_split=("query", "key", "value")), (32, 256)),
    "LayerNormMLP": (te.LayerNormMLP, (256, 256), dict(activation="swiglu", normalization="RMSNorm"), (32, 256)),
    "TransformerLayer": (te.TransformerLayer, (256, 256, 2),
                         dict(num_gqa_groups=1, hidden_dropout=0.0, attention_dropout=0.0), (8, 2, 256)),
}


def _recipe(dim=2, **kw):
    return R.Float8BlockScaling(w_block_scaling_dim=dim, **kw)


def _build(name, recipe=None, preserve=True, seed=11):
    cls, args, kw, _ = MODULES[name]
    torch.manual_seed(seed)
    if recipe is None:
        return cls(*args, **kw)
    with te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=preserve):
        return cls(*args, **kw)


def _fp8(module):
    return [(n, p) for n, p in module.named_parameters() if isinstance(p, Float8Weight)]


def _want(value, dim, recipe=None):
    qp = (recipe or _recipe(dim)).qparams("w")
    return quantize_blockwise_reference(value.detach().reshape(-1, value.shape[-1]), E4M3, dim,
                                        pow2=qp.power_2_scale, eps=qp.amax_epsilon)


def _assert_encodes(w, value, dim, recipe=None):
    want = _want(value, dim, recipe)
    assert torch.equal(w._data.view(torch.uint8), want.data.view(torch.uint8).view(w.shape)), "bytes differ"
    assert torch.equal(w.scale_inv, want.scale_inv), "block scales differ"


def _bytes(t):
    return t._data.reshape(t.shape).view(torch.uint8)


@pytest.mark.parametrize("qparams", ["pow2", "fp32-eps"])
@pytest.mark.parametrize("blocks", list(DIMS))
def test_bytes_are_the_block_quantization_of_the_initial_values(blocks, qparams):
    """Each GEMM weight holds quantize_blockwise_reference(W) bit for bit: its bytes (1 byte per element,
    no high-precision copy) and scale_inv [ceil(N/128), ceil(K/128)] (blocks) or [ceil(K/128), N] (tiles)."""
    dim = DIMS[blocks]
    kw = {} if qparams == "pow2" else dict(fp8_quant_fwd_weight=R.QParams(power_2_scale=False, amax_epsilon=1e-3))
    recipe = _recipe(dim, **kw)
    ref, fp8 = _build("LayerNormMLP"), _build("LayerNormMLP", recipe, preserve=False)
    for (n, w), p in zip(fp8.named_parameters(), ref.parameters()):
        if not isinstance(w, Float8Weight):
            assert torch.equal(w, p), n
            continue
        _assert_encodes(w, p, dim, recipe)
        n_rows, k = w.shape
        tiles = ((k + 127) // 128, n_rows) if dim == 1 else ((n_rows + 127) // 128, (k + 127) // 128)
        assert w.scale_inv.shape == tiles, n
        assert not any(b.shape == w.shape for b in fp8.buffers()), f"a high-precision copy of {n} is kept"
        assert w._data.element_size() == 1 and w.get_high_precision_init_val() is None
        assert w.dtype == torch.float32 and isinstance(w, torch.nn.Parameter) and w.requires_grad


@pytest.mark.parametrize("blocks", list(DIMS))
def test_dequantize_error(blocks):
    """dequantize() is the block-dequantized value (exactly the reference's), within E4M3's rounding of
    each element: |w - deq| <= 2^-4 |w| for normal values, 2^-10 * scale_inv in the subnormal range."""
    dim = DIMS[blocks]
    ref, fp8 = _build("Linear"), _build("Linear", _recipe(dim))
    w, hp = fp8.weight, ref.weight.detach()
    deq = w.dequantize()
    assert type(deq) is torch.Tensor and deq.dtype == torch.float32
    assert torch.equal(deq, _want(hp, dim).dequantize())
    tiles = w.scale_inv.double()
    per_element = (tiles.t().repeat_interleave(128, 1)[:, :hp.shape[1]] if dim == 1
                   else tiles.repeat_interleave(128, 0)[:hp.shape[0]].repeat_interleave(128, 1)[:, :hp.shape[1]])
    bound = 2.0 ** -4 * hp.double().abs() + 2.0 ** -10 * per_element
    assert bool(((deq.double() - hp.double()).abs() <= bound).all())
    rel = (deq.double() - hp.double()).norm() / hp.double().norm()
    assert rel < 2 ** -5, f"relative error {rel:.3g}"
    assert torch.equal(w.get_high_precision_init_val(), hp)


@pytest.mark.parametrize("blocks", list(DIMS))
def test_writes_requantize(blocks):
    """copy_, .data.copy_, in-place ops and load_state_dict re-quantize the new value in blocks; a
    Float8Weight source of the same blocks is copied byte for byte."""
    dim = DIMS[blocks]
    fp8 = _build("Linear", _recipe(dim))
    w = fp8.weight
    new = torch.randn(w.shape) * 3
    for write in (lambda v: w.copy_(v), lambda v: w.data.copy_(v),
                  lambda v: fp8.load_state_dict({**fp8.state_dict(), "weight": v})):
        with torch.no_grad():
            write(new)
        _assert_encodes(w, new, dim)
        new = new * 0.5
    value = w.dequantize()
    with torch.no_grad():
        w.mul_(2.0)
    assert torch.equal(w.dequantize(), value * 2.0)  # power-of-two scales: exact
    other = _build("Linear", _recipe(dim), seed=5)
    other.load_state_dict(fp8.state_dict())
    assert torch.equal(_bytes(other.weight), _bytes(w)) and torch.equal(other.weight._scales, w._scales)
    plain = _build("Linear")
    plain.load_state_dict(fp8.state_dict())  # a high-precision model takes the values
    assert torch.equal(plain.weight, w.dequantize())
    other.load_state_dict(plain.state_dict())  # and an FP8 model quantizes them back
    assert torch.equal(_bytes(other.weight), _bytes(w))


@pytest.mark.parametrize("blocks", list(DIMS))
def test_master_weights_step(blocks):
    """MasterWeights + SGD: the masters start from the preserved initial values, step in fp32, and the FP8
    weights are re-quantized from them (the blocks' scales from the new values)."""
    dim = DIMS[blocks]
    fp8 = _build("LayerNormMLP", _recipe(dim))
    masters = MasterWeights(fp8.parameters())
    opt = torch.optim.SGD(masters.parameters(), lr=0.5)
    with te.fp8_autocast(fp8_recipe=_recipe(dim)):
        fp8(torch.randn(*MODULES["LayerNormMLP"][3])).float().pow(2).mean().backward()
    before = {n: m.detach().clone() for (n, _), m in zip(fp8.named_parameters(), masters.parameters())}
    grads = {n: p.grad.clone() for n, p in fp8.named_parameters()}
    masters.step(opt)
    for (n, p), m in zip(fp8.named_parameters(), masters.parameters()):
        assert torch.equal(m.detach(), before[n] - 0.5 * grads[n]), n
        if isinstance(p, Float8Weight):
            _assert_encodes(p, m, dim)
        assert p.grad is None


@pytest.mark.parametrize("blocks", list(DIMS))
@pytest.mark.parametrize("name", list(MODULES))
def test_forward_backward_equals_dequantized_weights(name, blocks):
    """Two steps: the module with FP8 weights (MasterWeights + SGD) against the same module with
    high-precision weights set to the FP8 weights' dequantized values before each step: outputs, input
    gradient and every parameter gradient bit-equal."""
    dim = DIMS[blocks]
    recipe = _recipe(dim)
    fp8, ref = _build(name, recipe), _build(name)
    assert len(_fp8(fp8)) == {"Linear": 1, "Linear-split": 3, "LayerNormMLP": 2, "TransformerLayer": 6}[name]
    masters = MasterWeights(fp8.parameters())
    opt = torch.optim.SGD(masters.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(3)
    for step in range(2):
        with torch.no_grad():
            for p, q in zip(ref.parameters(), fp8.parameters()):
                p.copy_(q.dequantize() if isinstance(q, Float8Weight) else q)
        assert_same_step(ref, fp8, torch.randn(*MODULES[name][3], generator=g), recipe, step)
        ref.zero_grad(set_to_none=True)
        masters.step(opt)


@pytest.mark.parametrize("name", ["Linear", "LayerNormMLP"])
def test_128x128_training_equals_high_precision_weights(name):
    """128x128 blocks: the bytes are a pure function of the value and dgrad reads them transposed, so FP8
    weights with fp32 masters train bit-equal to fp32 weights cast in every forward (three SGD steps)."""
    recipe = _recipe(2)
    fp8, ref = _build(name, recipe), _build(name)
    masters = MasterWeights(fp8.parameters())
    opt_fp8, opt_ref = torch.optim.SGD(masters.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(4)
    for step in range(3):
        x = torch.randn(*MODULES[name][3], generator=g)
        with te.fp8_autocast(fp8_recipe=recipe):
            y_ref, y_fp8 = ref(x), fp8(x)
        y_ref.float().pow(2).mean().backward()
        y_fp8.float().pow(2).mean().backward()
        assert torch.equal(y_ref, y_fp8), f"step {step}: outputs differ"
        for (n, p), q in zip(ref.named_parameters(), fp8.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: gradient of {n} differs"
        masters.step(opt_fp8)
        opt_ref.step()
        opt_ref.zero_grad(set_to_none=True)


def test_weight_operand_is_the_stored_blocks():
    """weight_operand: a BlockwiseTensor of the stored bytes [N, K] and scale_inv, no copy; 1x128 tiles add
    the columnwise direction (dgrad's tiles along N) from the value when a backward will run."""
    fp8 = _build("Linear", _recipe(2))
    op = weight_operand("Linear", fp8.weight, _recipe(2))
    assert type(op) is BlockwiseTensor and op.block_dim == 2 and op.shape == fp8.weight.shape
    assert op.data.data_ptr() == fp8.weight._data.data_ptr()
    assert op.scale_inv.data_ptr() == fp8.weight._scales.data_ptr()
    assert op.data_t is None
    tiles = _build("Linear", _recipe(1))
    op = weight_operand("Linear", tiles.weight, _recipe(1))
    assert op.block_dim == 1 and op.scale_inv.shape == (2, 384) and op.data.data_ptr() == tiles.weight._data.data_ptr()
    want = _want(tiles.weight.dequantize().t(), 1)
    assert torch.equal(op.data_t.view(torch.uint8), want.data.view(torch.uint8))
    with torch.no_grad():
        assert weight_operand("Linear", tiles.weight, _recipe(1)).data_t is None


def test_split_pieces():
    """parameters_split: views of one FP8 buffer whose blocks are each piece's own (pieces of whole 128-row
    blocks); a piece written alone changes only its bytes and scales; the forward joins them without a copy."""
    fp8 = _build("Linear-split", _recipe(2))
    q, k, v = fp8.query_weight, fp8.key_weight, fp8.value_weight
    assert q._scales is k._scales is v._scales and k._data.storage_offset() == q._data.numel()
    assert k.scale_inv.data_ptr() == q._scales[1:2].data_ptr()
    before = [(_bytes(p).clone(), p.scale_inv.clone()) for p in (q, v)]
    new = torch.randn(k.shape) * 5
    with torch.no_grad():
        k.copy_(new)
    _assert_encodes(k, new, 2)
    for p, (b, s) in zip((q, v), before):
        assert torch.equal(_bytes(p), b) and torch.equal(p.scale_inv, s), "a piece written alone changed another"
    values = [torch.randn(p.shape) for p in (q, k, v)]
    write_fp8_weights(zip((q, k, v), values))
    _assert_encodes(_joined(q, k, v), torch.cat(values), 2)


def _joined(*pieces):
    whole = cat_fp8_weights(pieces)
    assert whole._data.data_ptr() == pieces[0]._data.data_ptr(), "adjacent pieces were copied"
    return whole


def test_split_pieces_must_hold_whole_blocks():
    """128x128 blocks cannot straddle two pieces: refused at construction in one line naming the rows;
    1x128 tiles take any split (each row's scales are its own)."""
    split = {"query": 192, "key": 96, "value": 96}
    with pytest.raises(ValueError, match=r"rows 192\.\.288 would start inside a block.*multiples of 128") as e:
        with te.quantized_model_init(recipe=_recipe(2)):
            te.Linear(256, 384, parameters_split=split)
    assert "\n" not in str(e.value)
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=_recipe(1)):
        m = te.Linear(256, 384, parameters_split=split)
    values = [torch.randn(p.shape) for p in (m.query_weight, m.key_weight, m.value_weight)]
    write_fp8_weights(zip((m.query_weight, m.key_weight, m.value_weight), values))
    _assert_encodes(_joined(m.query_weight, m.key_weight, m.value_weight), torch.cat(values), 1)
    with torch.no_grad():
        m.key_weight.copy_(values[1] * 3)
    _assert_encodes(m.key_weight, values[1] * 3, 1)
    with te.fp8_autocast(fp8_recipe=_recipe(1)):
        m(torch.randn(32, 256)).sum().backward()


def test_refusals():
    """One line each: a weight run under another recipe kind or block shape."""
    blocks = _build("Linear", _recipe(2))
    tiles = _build("Linear", _recipe(1))
    per_tensor = _build("Linear", R.Float8CurrentScaling())
    x = torch.randn(32, 256)
    cases = [(blocks, R.Float8CurrentScaling(), r"built for Float8BlockScaling \(128x128 blocks\).*cannot run under "
                                               r"Float8CurrentScaling"),
             (blocks, R.DelayedScaling(), "cannot run under DelayedScaling"),
             (blocks, _recipe(1), r"cannot run under Float8BlockScaling \(1x128 tiles\)"),
             (tiles, _recipe(2), r"built for Float8BlockScaling \(1x128 tiles\)"),
             (per_tensor, _recipe(2), r"built for Float8CurrentScaling with .* cannot run under Float8BlockScaling")]
    for module, recipe, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            with te.fp8_autocast(fp8_recipe=recipe):
                module(x)
        assert "\n" not in str(e.value)


def test_write_ending_inside_a_block():
    """Rows written that end inside a 128x128 block: the block is encoded again with its other rows'
    current values (zeros written: a smaller amax, so those rows keep their values exactly)."""
    w = _build("Linear", _recipe(2)).weight
    before = w.dequantize()
    with torch.no_grad():
        w[:64].copy_(torch.zeros(64, 256))
        w[256:].copy_(torch.ones(128, 256))
    after = w.dequantize()
    assert torch.equal(after[:64], torch.zeros(64, 256)) and torch.equal(after[64:256], before[64:256])
    assert torch.equal(after[256:], torch.ones(128, 256))
    _assert_encodes(w, after, 2)


def test_state_dict_file_round_trip_and_deepcopy():
    """torch.save writes the bytes and block scales; a fresh FP8 model loads them byte for byte; deepcopy
    keeps split pieces on one buffer and the quantizer on the copy."""
    fp8 = _build("TransformerLayer", _recipe(2))
    buf = io.BytesIO()
    torch.save(fp8.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    fresh = _build("TransformerLayer", _recipe(2), seed=3)
    fresh.load_state_dict(loaded)
    for (n, a), b in zip(fp8.named_parameters(), fresh.parameters()):
        assert torch.equal(a.detach(), b.detach()), n
        if isinstance(a, Float8Weight):
            assert torch.equal(_bytes(a), _bytes(b)) and torch.equal(a.scale_inv, b.scale_inv), n
    twin = copy.deepcopy(fp8)
    qkv = twin.self_attention.layernorm_qkv
    assert qkv.query_weight._scales is qkv.value_weight._scales
    assert qkv.query_weight._blocks == fp8.self_attention.layernorm_qkv.query_weight._blocks
    assert twin.layernorm_mlp.fc1_weight._quantizer.module is twin.layernorm_mlp
    assert torch.equal(twin.layernorm_mlp.fc2_weight.dequantize(), fp8.layernorm_mlp.fc2_weight.dequantize())


def test_distributed_checkpoint_saves_values(tmp_path):
    """dcp_state_dict holds an FP8 weight as its value: a high-precision model loads it exactly, and an
    FP8-weight model of the same blocks gets the same bytes and scales back (one process)."""
    saved = _build("Linear", _recipe(2))
    plain, fp8 = _build("Linear", seed=1), _build("Linear", _recipe(2), seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: no process group, one process
        dcp.save(te.dcp_state_dict(saved), checkpoint_id=str(tmp_path))
        for net in (plain, fp8):
            sd = te.dcp_state_dict(net)
            dcp.load(sd, checkpoint_id=str(tmp_path))
            te.load_dcp_state_dict(net, sd)
    assert torch.equal(plain.weight, saved.weight.dequantize())
    assert torch.equal(_bytes(fp8.weight), _bytes(saved.weight))
    assert torch.equal(fp8.weight.scale_inv, saved.weight.scale_inv)


def test_to_clone_and_meta_build():
    """.to(bfloat16) and clone keep the bytes and blocks; built on meta, to_empty + reset_parameters gives
    the FP8 weights a direct build has."""
    fp8 = _build("LayerNormMLP", _recipe(2))
    w = fp8.fc1_weight
    half, twin = w.detach().to(torch.bfloat16), w.detach().clone()
    for t in (half, twin):
        assert type(t) is Float8Weight and torch.equal(_bytes(t), _bytes(w)) and torch.equal(t.scale_inv, w.scale_inv)
    assert half.dtype == torch.bfloat16 and twin._scales is not w._scales
    torch.manual_seed(11)
    cls, args, kw, _ = MODULES["LayerNormMLP"]
    with te.quantized_model_init(recipe=_recipe(2), preserve_high_precision_init_val=True):
        lazy = cls(*args, device="meta", **kw)
    torch.manual_seed(11)
    lazy.to_empty(device="cpu")
    lazy.reset_parameters()
    for (n, a), b in zip(fp8.named_parameters(), lazy.parameters()):
        assert type(a) is type(b) and torch.equal(a.detach(), b.detach()), n


class _Mesh:
    def __init__(self, size):
        self._size = size

    def size(self):
        return self._size


def _fsdp_shards(w, world):
    """What fully_shard does to a parameter: chunk dim 0, copy each chunk into a zero-padded shard."""
    chunks = torch.chunk(w.detach(), world, dim=0)
    shards = []
    for c in chunks:
        padded = c.new_zeros(chunks[0].shape)
        padded.narrow(0, 0, c.shape[0]).copy_(c)
        shards.append(torch.as_strided(padded.view(-1), c.shape, (c.shape[1], 1), 0))
    return shards


def _gather(shards, orig_size, dtype=torch.float32, out=None, buffers=None):
    """fsdp_pre_all_gather on each shard, the all-gather (concatenation: into `buffers`, the outputs of the
    first gather, when FSDP re-gathers into the same unsharded tensor `out`), fsdp_post_all_gather.
    Returns (its result, the all-gather outputs)."""
    world = len(shards)
    inputs, metas = zip(*[s.fsdp_pre_all_gather(_Mesh(world), orig_size, None, None, None) for s in shards])
    outputs = [torch.cat([i[j].reshape(-1) for i in inputs]).view(-1, *inputs[0][j].shape[1:])
               for j in range(len(inputs[0]))]
    if buffers is not None:
        for b, o in zip(buffers, outputs):
            b.copy_(o)
        outputs = buffers
    return shards[0].fsdp_post_all_gather(tuple(outputs), metas[0], dtype, out=out), outputs


@pytest.mark.parametrize("blocks,rows", [("128x128", 512), ("1x128", 384), ("1x128", 96)])
def test_fsdp_shards_and_all_gather(blocks, rows):
    """FSDP2's ops on a block-scaled weight keep FP8 shards whose blocks are their rows'; the all-gather
    hooks move 1 byte per element plus the shards' scales and rebuild the unsharded weight: bytes and
    scales equal the unsharded module's, also when re-gathered into the same tensor."""
    dim = DIMS[blocks]
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=_recipe(dim)):
        m = te.Linear(256, rows)
    w = m.weight
    shards = _fsdp_shards(w, 2)
    for i, s in enumerate(shards):
        assert type(s) is Float8Weight and s._scales is not w._scales
        assert torch.equal(s.dequantize(), w.dequantize()[i * rows // 2:(i + 1) * rows // 2])
    inputs, _ = shards[0].fsdp_pre_all_gather(_Mesh(2), w.shape, None, None, None)
    assert [t.dtype for t in inputs] == [torch.uint8, torch.float32] and inputs[0].numel() == w.numel() // 2
    (full, _), buffers = _gather(shards, w.shape, torch.bfloat16)
    assert type(full) is Float8Weight and full.dtype == torch.bfloat16 and full.shape == w.shape
    assert torch.equal(_bytes(full), _bytes(w)) and torch.equal(full.scale_inv, w.scale_inv)
    with torch.no_grad():  # a training step writes each shard on its own; the next gather refills `full`
        for s in shards:
            s.copy_(s.dequantize() * 4)
    assert _gather(shards, w.shape, torch.bfloat16, out=full, buffers=buffers)[0] is None
    assert torch.equal(full.dequantize(torch.float32), w.dequantize() * 4)


def test_fsdp_refuses_shards_that_cut_blocks():
    """128x128 blocks: FSDP2's chunk of ceil(N/world) rows must be whole blocks (refused when fully_shard
    chunks the weight), and shards must be equal (refused at the first all-gather, on every rank alike);
    1x128 tiles: equal shards of any rows."""
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=_recipe(2)):
        m = te.Linear(256, 384)
    with pytest.raises(ValueError, match=r"\(384, 256\) in 128x128 blocks: a view of its rows 192\.\.384") as e:
        torch.chunk(m.weight.detach(), 2, dim=0)
    assert "\n" not in str(e.value)
    with te.quantized_model_init(recipe=_recipe(2)):
        m255 = te.Linear(256, 255)
    with pytest.raises(ValueError, match=r"FSDP2 over 2 ranks: .* \(255, 256\) in 128x128 blocks needs equal shards "
                                         r"of whole 128-row blocks \(rows a multiple of 256\)"):
        _gather(_fsdp_shards(m255.weight, 2), m255.weight.shape)
    with te.quantized_model_init(recipe=_recipe(1)):
        m3 = te.Linear(256, 99)
    with pytest.raises(ValueError, match=r"in 1x128 tiles needs equal shards of rows \(rows a multiple of 2\)"):
        _gather(_fsdp_shards(m3.weight, 2), m3.weight.shape)
