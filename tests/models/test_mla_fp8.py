"""The ``fp8_ds_mla`` latent KV cache (``models/mla_fp8.py``, ``--kv-cache-dtype fp8_ds_mla``):
the 584-byte row layout, its rounding bound, and the tiny V4 pair decoding losslessly from it."""
import pytest
import torch

from dspark_trt.config import ConfigError
from dspark_trt.models import mla_fp8
from dspark_trt.runtime import LLM, SamplingParams
from tests.models.test_v4_generate import PROMPTS, ScriptedDraft


def _rows(shape, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-4, 3, shape[-1], dtype=torch.float64)       # rows of very different size
    return torch.randn(*shape, dim, generator=g, dtype=torch.float64) * scale[:, None]


def test_row_layout_is_vllms_584_bytes_at_v4_dims():
    assert mla_fp8.row_bytes(512, 64) == 448 + 8 + 128 == 584
    assert mla_fp8.row_bytes(32, 8) == 24 + 8 + 16                       # tiny: one NoPE block of 24
    rows = mla_fp8.pack(_rows((2, 3), 512), 64)
    assert rows.dtype == torch.uint8 and rows.shape == (2, 3, 584)
    exp = rows[..., 448:455].long() - 127                                # 7 ue8m0 scale bytes + 1 pad
    assert bool((rows[..., 455] == 0).all()) and bool((exp > -127).all())
    with pytest.raises(ValueError, match="584"):
        mla_fp8.unpack(rows[..., :583], 512, 64, torch.float32)
    with pytest.raises(ValueError, match="RoPE"):
        mla_fp8.row_bytes(64, 0)


@pytest.mark.parametrize("dim, rope", [(512, 64), (32, 8)])
def test_round_trip_keeps_rope_exact_and_nope_within_e4m3_rounding(dim, rope):
    """RoPE dims come back as their bf16 values; a NoPE value x of a block with scale s (the least
    power of two with amax / s <= 448) within half an e4m3 step: 2^-4 |x| in the normal range,
    2^-10 s below it (subnormals)."""
    x = _rows((4, 6), dim)
    y = mla_fp8.unpack(mla_fp8.pack(x, rope), dim, rope, torch.float64)
    nope = dim - rope
    assert torch.equal(y[..., nope:], x[..., nope:].to(torch.bfloat16).double())
    blk = mla_fp8.nope_block(nope)
    xb, yb = x[..., :nope].unflatten(-1, (-1, blk)), y[..., :nope].unflatten(-1, (-1, blk))
    s = torch.exp2(torch.ceil(torch.log2(xb.abs().amax(-1, keepdim=True) / 448.0)))
    err = (yb - xb).abs()
    assert bool((err <= 2.0 ** -4 * xb.abs() + 2.0 ** -10 * s).all())
    assert float(err.max()) > 0                                          # it does quantise
    zero = mla_fp8.pack(torch.zeros(2, dim), rope)
    assert torch.equal(mla_fp8.unpack(zero, dim, rope, torch.float32), torch.zeros(2, dim))
    assert torch.equal(mla_fp8.unpack(torch.zeros_like(zero), dim, rope, torch.float32), torch.zeros(2, dim))


def _tiny(kv_cache_dtype="auto", device="cpu", dtype=torch.float64, **kw):
    return LLM.from_preset("deepseek-v4-tiny-dspark", dtype=dtype, device=device, max_batch_size=2,
                           max_seq_len=160, page_size=16, kv_cache_dtype=kv_cache_dtype, **kw)


@pytest.fixture(scope="module")
def fp8():
    return _tiny("fp8_ds_mla")


def test_caches_hold_fp8_rows_and_cost_fewer_bytes(fp8):
    ref = _tiny()
    for cache in (fp8.networks.target_cache, fp8.networks.draft_cache):
        for layer in cache["layers"]:
            assert layer["kv"].dtype == torch.uint8 and layer["kv"].shape[-1] == mla_fp8.row_bytes(32, 8)
    assert fp8.kv_cache_dtype == "fp8_ds_mla" and ref.kv_cache_dtype == "auto"
    stages = len(fp8.networks.draft_cache["layers"])
    assert fp8.draft.kv_bytes_per_token(torch.float64) == stages * 48
    assert ref.draft.kv_bytes_per_token(torch.float64) == stages * 32 * 8
    assert fp8._kv_bytes_per_token(True) < ref._kv_bytes_per_token(True)


def test_speculative_decoding_from_the_fp8_cache_is_lossless(fp8):
    """Greedy speculative output equals the target's own greedy output over the same fp8 cache,
    with the real draft and with drafts forced to be accepted in part (0..N per round); the fp8
    rows move the logits against the full-precision cache, by less than 5 % of their range."""
    new = 40
    ar = [o.output_ids for o in fp8.generate(PROMPTS, SamplingParams(max_new_tokens=new), speculative=False)]
    spec = fp8.generate(PROMPTS, SamplingParams(max_new_tokens=new))
    assert [o.output_ids for o in spec] == ar
    nets = fp8.networks
    fp8.networks = ScriptedDraft(nets, [p + r for p, r in zip(PROMPTS, ar)])
    fp8._steps = None
    try:
        forced = fp8.generate(PROMPTS, SamplingParams(max_new_tokens=new))
    finally:
        fp8.networks, fp8._steps = nets, None
    assert [o.output_ids for o in forced] == ar
    assert max(max(o.stats.accepted) for o in forced) >= 2 and min(min(o.stats.accepted) for o in forced) == 0
    ref = _tiny()
    tokens = torch.tensor([PROMPTS[0]])
    table = torch.arange(-(-tokens.shape[1] // 16))[None]                 # pages 0.. (all free now)
    logits = [m.target(tokens, torch.arange(tokens.shape[1])[None], table, m.networks.target_cache)[0]
              for m in (fp8, ref)]
    diff = (logits[0] - logits[1]).abs().max()
    assert 0 < diff < 0.05 * (logits[1].max() - logits[1].min())


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ConfigError, match="MLA"):
        LLM.from_preset("qwen3-tiny-dspark", dtype=torch.float32, device="cpu", max_batch_size=1,
                        max_seq_len=32, kv_cache_dtype="fp8_ds_mla")
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        _tiny("fp8")
    from dspark_trt.runtime.llm import set_kv_cache_dtype
    with pytest.raises(ConfigError, match="engines"):
        set_kv_cache_dtype("fp8_ds_mla", None, None, networks=object())
    # "auto" resets modules an earlier LLM set to fp8; dims that do not fit are named
    fp8 = _tiny("fp8_ds_mla")
    again = LLM(fp8.pair, fp8.target, fp8.draft, device="cpu", max_batch_size=1, max_seq_len=64, page_size=16)
    assert again.kv_cache_dtype == "auto" and again.networks.target_cache["layers"][0]["kv"].dtype == torch.float64
    fp8.target.layers[-1].attn.cfg = type(fp8.target.config)(**{**vars(fp8.target.config), "qk_rope_head_dim": 32})
    with pytest.raises(ConfigError, match="NoPE"):                    # head_dim 32: no NoPE left
        set_kv_cache_dtype("fp8_ds_mla", fp8.target, None, None)
    assert all(layer.attn.kv_format == "auto" for layer in fp8.target.layers)   # nothing set


def test_info_reports_the_fp8_latent_kv():
    from dspark_trt.commands.info import memory_estimate
    plan = memory_estimate("deepseek-v4-tiny-dspark", torch.bfloat16, 1, 64)
    bf16, fp8 = plan["kv_bytes_per_token"], plan["kv_bytes_per_token_fp8_ds_mla"]
    assert bf16["draft"] - fp8["draft"] == (bf16["draft"] // 64) * (64 - 48)       # per stage row
    assert fp8["target"] < bf16["target"]
    assert "kv_bytes_per_token_fp8_ds_mla" not in memory_estimate("qwen3-tiny-dspark", torch.float32, 1, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_cache_on_gpu_with_graphs_is_lossless():
    """bf16 on the GPU, CUDA graphs (the rows' gather and decode captured), the Triton sparse MLA
    kernel on the decoded rows: speculative output equals the target's over the same cache."""
    llm = _tiny("fp8_ds_mla", device="cuda", dtype=torch.bfloat16, cuda_graphs=True)
    ar = [o.output_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=32), speculative=False)]
    assert [o.output_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=32))] == ar


def test_gathered_and_whole_cache_rows_give_the_same_attention():
    """``attention_rows`` gathers the named rows (few queries) or decodes the whole cache (many):
    the sparse MLA attention over either is the same, and -1 entries stay skipped."""
    from dspark_trt import plugins
    g = torch.Generator().manual_seed(3)
    D, rope, R, N, K, H = 32, 8, 40, 6, 9, 4
    rows = mla_fp8.pack(_rows((R,), D, seed=4).float(), rope)
    idx = torch.randint(-1, R, (N, K), generator=g, dtype=torch.int32)
    q = torch.randn(N, H, D, generator=g)
    sink = torch.zeros(H)
    outs = []
    for gather in (True, False):
        kv, i = mla_fp8.attention_rows(rows, idx, D, rope, torch.float32, gather)
        assert kv.shape == ((N * K, D) if gather else (R, D)) and bool(((i < 0) == (idx < 0)).all())
        outs.append(plugins.sparse_mla_attention(q, kv, i, sink, D ** -0.5, D))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    assert mla_fp8.attention_rows(rows, idx, D, rope, torch.float32)[0].shape == (R, D)   # 54 entries > 40 rows
