"""V4 hyper-connections and MoE routing against their formulas."""
import pytest
import torch
import torch.nn.functional as F

from dspark_trt.config import get_preset
from dspark_trt.models.v4_hc import HyperConnection, HyperHead, sinkhorn
from dspark_trt.models.v4_moe import Expert, MoE


def test_sinkhorn_is_doubly_stochastic():
    """Unit-scale logits: 20 iterations reach 1e-5 (strongly peaked logits converge slower)."""
    logits = torch.randn(50, 4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    m = sinkhorn(logits, 20, 1e-6)
    assert (m > 0).all()
    torch.testing.assert_close(m.sum(-2), torch.ones(50, 4, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(m.sum(-1), torch.ones(50, 4, dtype=torch.float64), atol=1e-5, rtol=0)


def test_hc_pre_post_match_the_formulas():
    torch.manual_seed(1)
    hc, d = 4, 8
    mod = HyperConnection(hc, d, 20, 1e-6, 1e-6).double()
    x = torch.randn(3, hc, d, dtype=torch.float64)
    y, post, comb = mod.pre(x)
    xf = x.flatten(-2)
    mix = (xf @ mod.fn.T) / (xf.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    pre = torch.sigmoid(mix[:, :4] * mod.scale[0] + mod.base[:4]) + 1e-6
    torch.testing.assert_close(y, (pre[..., None] * x).sum(1))
    torch.testing.assert_close(post, 2 * torch.sigmoid(mix[:, 4:8] * mod.scale[1] + mod.base[4:8]))
    f = torch.randn(3, d, dtype=torch.float64)
    out = mod.post(f, x, post, comb)
    for k in range(hc):
        want = post[:, k, None] * f + sum(comb[:, j, k, None] * x[:, j] for j in range(hc))
        torch.testing.assert_close(out[:, k], want)
    head = HyperHead(hc, d, 1e-6, 1e-6).double()
    w = torch.sigmoid((xf @ head.fn.T) / (xf.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * head.scale
                      + head.base) + 1e-6
    torch.testing.assert_close(head(x), (w[..., None] * x).sum(1))


@pytest.fixture
def cfg():
    return get_preset("deepseek-v4-tiny-dspark").target


def test_router_bias_selects_but_does_not_weight(cfg):
    torch.manual_seed(2)
    moe = MoE(cfg, hashed=False).double()
    x = torch.randn(5, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        moe.gate.bias[3] = 100.0                       # expert 3 always selected
    w, idx = moe.gate(x, torch.zeros(5, dtype=torch.long))
    scores = F.softplus(x @ moe.gate.weight.T).sqrt()
    assert (idx == 3).any(-1).all()
    torch.testing.assert_close(w, scores.gather(-1, idx) / scores.gather(-1, idx).sum(-1, keepdim=True)
                               * cfg.routed_scaling_factor)


def test_hash_routing_uses_tid2eid(cfg):
    torch.manual_seed(3)
    moe = MoE(cfg, hashed=True).double()
    ids = torch.tensor([0, 7, 300])
    _, idx = moe.gate(torch.randn(3, cfg.hidden_size, dtype=torch.float64), ids)
    assert torch.equal(idx, moe.gate.tid2eid[ids])
    assert moe.gate.bias is None


def test_expert_clamps_swiglu():
    torch.manual_seed(4)
    e = Expert(4, 6, 10.0).double()
    x = torch.randn(3, 4, dtype=torch.float64) * 50
    g, u = e.w1(x), e.w3(x)
    assert g.max() > 10 and u.abs().max() > 10
    want = e.w2(F.silu(g.clamp(max=10)) * u.clamp(-10, 10) * 0.5)
    torch.testing.assert_close(e(x, torch.full((3,), 0.5, dtype=torch.float64)), want)
