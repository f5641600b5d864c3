"""te.convert with LLAMA_TP_PLAN: a TP=2 Hugging Face Llama gives the single-process logits and loss."""
import pytest
import torch
import torch.distributed as dist

import te_parallel as te
from tests.distributed.harness import Checks, spawn
from tests.reference import rel_err

pytest.importorskip("transformers", reason="needs transformers (pip install transformers)")


def _worker(rank, world, device):
    from tests.test_convert import llama

    group = dist.new_group(list(range(world)))
    checks = Checks(rank)

    def check():
        ref, tp = llama(device), llama(device)
        ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0)).to(device)
        te.convert(tp, tp_group=group, plan=te.LLAMA_TP_PLAN)
        assert tp.model.layers[0].self_attn.q_proj.weight.shape == (64 // world, 64)
        assert rel_err(tp(ids).logits, ref(ids).logits) < 1e-5
        lr, lt = ref(ids, labels=ids).loss, tp(ids, labels=ids).loss
        lr.backward()
        lt.backward()
        assert abs(lr.item() - lt.item()) < 1e-5
        g_ref = ref.model.layers[0].mlp.down_proj.weight.grad.chunk(world, 1)[rank]
        assert rel_err(tp.model.layers[0].mlp.down_proj.weight.grad, g_ref) < 1e-4

    checks.run("llama TP=2 via convert", check)
    checks.raise_if_failed()


def test_convert_llama_tensor_parallel():
    spawn(_worker, 2)
