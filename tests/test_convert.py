"""te.convert on a Hugging Face Llama built from a config (random weights, no download)."""
import pytest
import torch

import te_parallel as te
from te_parallel import recipe as R
from tests.reference import rel_err

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")


def llama(device):
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device).eval()


def test_convert_llama_numerics_and_fp8(device):
    model = llama(device)
    ids = torch.randint(0, 128, (2, 32), device=device)
    before = model(ids).logits
    te.convert(model)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Linear" in kinds and "RMSNorm" in kinds and not any(type(m) is torch.nn.Linear for m in model.modules())
    after = model(ids).logits
    assert rel_err(after, before) < 1e-6  # RMSNorm's rounding order is the only difference
    with te.fp8_autocast(fp8_recipe=R.DelayedScaling()):
        fp8 = model(ids).logits
    with te.fp8_autocast(fp8_recipe=R.DelayedScaling()):  # second pass: scales from real amaxes
        fp8 = model(ids).logits
    assert 1e-4 < rel_err(fp8, before) < 0.1
    model.train()
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_convert_torch_modules(device):
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.RMSNorm(64, eps=1e-6),
                                torch.nn.Linear(64, 16, bias=False)).to(device)
    x = torch.randn(8, 32, device=device)
    before = model(x)
    te.convert(model)
    assert [type(m).__name__ for m in model] == ["Linear", "LayerNorm", "RMSNorm", "Linear"]
    assert rel_err(model(x), before) < 1e-6


def test_plan_needs_group():
    with pytest.raises(ValueError, match="needs tp_group"):
        te.convert(torch.nn.Linear(4, 4), plan=te.LLAMA_TP_PLAN)
