"""The draft over a frequency-ranked sub-vocabulary (``models/draft_vocab.py``): the file, the
ranking, the sampler over the set (exactly the full sampler when the set is everything; the greedy
drafts and logits of the full sampler over logits masked to the set otherwise), greedy generation
equal to the target's, and the ``--draft-vocab`` / ``dspark-trt draft-vocab`` commands."""
from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from dspark_trt.config import ConfigError
from dspark_trt.models import build_models
from dspark_trt.commands.draft_vocab import write_draft_vocab
from dspark_trt.models.dspark_qwen3 import confidence_logits
from dspark_trt.models.draft_vocab import DraftVocab, rank_tokens, read_draft_vocab, restrict_draft_vocab_
from dspark_trt.plugins.markov_sample import markov_sample_ref
from dspark_trt.runtime import LLM, SamplingParams

from tests.support.models import tiny_pair

V = 64


def test_rank_tokens_orders_by_count_then_id_and_keeps_the_required_ids():
    counts = torch.tensor([5, 9, 9, 0, 1, 7, 0, 2])
    assert rank_tokens(counts, 3).tolist() == [1, 2, 5]           # 9, 9 (smaller id first), 7
    assert rank_tokens(counts, 2).tolist() == [1, 2]
    assert rank_tokens(counts, 3, always=(6,)).tolist() == [1, 2, 6]
    with pytest.raises(ConfigError, match="size 9"):
        rank_tokens(counts, 9)
    with pytest.raises(ConfigError, match=r"\[8\]"):
        rank_tokens(counts, 3, always=(8,))
    with pytest.raises(ConfigError, match="2 required"):
        rank_tokens(counts, 1, always=(3, 6))


def test_draft_vocab_file_round_trips(tmp_path):
    path = tmp_path / "v.json"
    write_draft_vocab(path, torch.tensor([3, 1, 40]), V, {"corpus": "x"})
    assert read_draft_vocab(path, V).tolist() == [1, 3, 40]
    assert json.loads(path.read_text())["source"] == {"corpus": "x"}


@pytest.mark.parametrize("doc,msg", [
    ("not json", "not a readable JSON"),
    ({"format": "other"}, "not a draft-vocabulary file"),
    ({"format": "dspark-draft-vocab", "version": 9}, "version 9"),
    ({"format": "dspark-draft-vocab", "version": 1, "token_ids": [1]}, "vocab_size.*positive integer"),
    ({"format": "dspark-draft-vocab", "version": 1, "vocab_size": "64", "token_ids": [1]}, "positive integer"),
    ({"format": "dspark-draft-vocab", "version": 1, "vocab_size": 32, "token_ids": [1]}, "vocabulary of 32"),
    ({"format": "dspark-draft-vocab", "version": 1, "vocab_size": V, "token_ids": []}, "non-empty list"),
    ({"format": "dspark-draft-vocab", "version": 1, "vocab_size": V, "token_ids": [1, "2"]}, "non-empty list"),
    ({"format": "dspark-draft-vocab", "version": 1, "vocab_size": V, "token_ids": [1, 64]}, r"\[64\]"),
    ({"format": "dspark-draft-vocab", "version": 1, "vocab_size": V, "token_ids": [1, 1]}, "repeats"),
])
def test_bad_draft_vocab_files_are_refused_naming_what_is_wrong(tmp_path, doc, msg):
    path = tmp_path / "v.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    for vocab_size in (V, None):                      # None: the check before the model loads
        if vocab_size is None and "vocabulary of 32" in msg:
            continue                                  # (a file's own vocabulary: checked once loaded)
        with pytest.raises(ConfigError, match=msg) as e:
            read_draft_vocab(path, vocab_size)
        assert str(path) in str(e.value)
    with pytest.raises(ConfigError, match="no such file"):
        read_draft_vocab(tmp_path / "missing.json", V)


def _pair_models(seed=7):
    pair = tiny_pair(vocab=V, block=5)
    target, draft = build_models(pair, torch.float64, "cpu", seed=seed)
    return pair, target, draft


def _restricted(draft, ids):
    d = copy.deepcopy(draft)
    d.lm_head = draft.lm_head                        # the target's own head, as built
    restrict_draft_vocab_(d, ids)
    return d


def _block(target, draft, temperature, B=2, T=6):
    """Prefill, draft context and one draft block with fresh caches -> (drafts, z)."""
    g = torch.Generator().manual_seed(0)
    tcache = target.make_cache(8, 8, torch.float64, "cpu")
    dcache = draft.make_cache(8, 8, torch.float64, "cpu")
    table = torch.arange(B * 4).view(B, 4)
    tokens = torch.randint(0, V, (B, T), generator=g)
    pos = torch.arange(T).repeat(B, 1)
    logits, taps = target(tokens, pos, table, tcache)
    draft.context(taps, pos, table, dcache)
    anchor = logits[:, -1].argmax(-1)
    return draft(anchor, torch.full((B,), T), table, temperature, torch.arange(1, B + 1), dcache)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_whole_vocabulary_as_the_set_samples_exactly_what_the_full_draft_does(temperature):
    _, target, draft = _pair_models()
    t = torch.full((2,), temperature)
    want = _block(target, draft, t)
    got = _block(target, _restricted(draft, torch.arange(V)), t)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_a_subset_proposes_only_its_tokens_with_the_masked_full_samplers_greedy_drafts_and_logits():
    _, target, draft = _pair_models()
    ids = torch.arange(1, V, 3)                                  # 21 of 64 tokens
    sub = _restricted(draft, ids)
    B, T = 3, 6
    table = torch.arange(B * 4).view(B, 4)
    dcache = sub.make_cache(B * 4, 8, torch.float64, "cpu")
    tcache = target.make_cache(B * 4, 8, torch.float64, "cpu")
    tokens = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T).repeat(B, 1)
    _, taps = target(tokens, pos, table, tcache)
    sub.context(taps, pos, table, dcache)
    anchor, start = torch.tensor([0, 5, -1]), torch.full((B,), T)       # 0 and 5: outside the set
    h = sub.block_hidden(anchor, start, table, dcache)
    drafts, z = sub.sample(sub.lm_head(h), anchor, torch.zeros(B), torch.zeros(B, dtype=torch.long), start)
    U = draft.lm_head(h)                                          # the full head on the same hidden states
    masked = torch.full_like(U, float("-inf"))
    masked[..., ids] = U[..., ids]
    w1, w2 = draft.markov_weights()
    want_d, want_z = markov_sample_ref(masked, anchor, w1, w2, torch.zeros(B), torch.zeros(B, dtype=torch.long), start)
    assert torch.equal(drafts, want_d) and torch.isin(drafts[:2], ids).all() and (drafts[2] == -1).all()
    assert torch.allclose(z, want_z, atol=1e-12, rtol=0)
    assert (torch.isfinite(z[:2]).sum(-1) == ids.numel()).all() and (z[2] == 0).all()      # inert row: 0
    assert sub.lm_head.weight.shape == (ids.numel(), draft.lm_head.weight.shape[1])
    assert draft.lm_head.weight.shape[0] == V                     # the target keeps its head


def test_restricting_twice_or_past_the_head_is_refused():
    _, _, draft = _pair_models()
    sub = _restricted(draft, torch.arange(4))
    with pytest.raises(ConfigError, match="already"):
        restrict_draft_vocab_(sub, torch.arange(4))
    for bad in ([2, 64], [-1, 2], []):
        with pytest.raises(ConfigError, match=r"each must be in 0\.\.63"):
            restrict_draft_vocab_(copy.deepcopy(draft), torch.tensor(bad, dtype=torch.long))
    with pytest.raises(ConfigError, match="repeat"):                 # q would be twice what z says
        restrict_draft_vocab_(copy.deepcopy(draft), torch.tensor([3, 5, 3]))


def test_a_head_that_is_not_one_plain_matrix_is_refused_by_name():
    _, _, draft = _pair_models()
    d = copy.deepcopy(draft)
    d.lm_head = torch.nn.Sequential(d.lm_head)                  # e.g. a vocabulary-parallel head
    with pytest.raises(ConfigError, match="it is a Sequential"):
        restrict_draft_vocab_(d, torch.arange(4))
    d.lm_head = copy.deepcopy(draft.lm_head).to(torch.float8_e4m3fn)
    with pytest.raises(ConfigError, match="Linear of torch.float8_e4m3fn"):
        restrict_draft_vocab_(d, torch.arange(4))


def test_markov_tables_index_the_set_then_every_token():
    w1, w2 = torch.randn(V, 4), torch.randn(V, 4)
    vocab = DraftVocab(torch.tensor([2, 9]), w1, w2)
    local, t1, t2 = vocab.markov_inputs(torch.tensor([9, -1]))
    assert local.tolist() == [11, -1] and torch.equal(t1[11], w1[9]) and torch.equal(t1[1], w1[9])
    assert torch.equal(t2, w2[[2, 9]])


def test_the_set_replaces_the_markov_head_holding_w1_once_and_the_sets_w2_rows_with_equal_confidence():
    """The restricted draft holds W1 [Vs + V, r] and W2 [Vs, r] only (not the Markov head's W1 and
    W2 beside them); its confidence logits equal the full draft's for the same drafts."""
    _, _, draft = _pair_models(seed=4)
    draft.add_confidence_head()
    ids = torch.arange(0, V, 3)
    sub = _restricted(draft, ids)
    r, Vs = draft.config.markov_rank, ids.numel()
    names = {n for n, _ in sub.named_parameters()} | {n for n, _ in sub.named_buffers()}
    assert sub.markov_head is None and not any(n.startswith("markov_head.") for n in names)
    markov = [t for n, t in sub.state_dict().items() if n.startswith("draft_vocab.w")]
    assert sorted(t.numel() for t in markov) == [Vs * r, (Vs + V) * r]
    with pytest.raises(RuntimeError, match="draft vocabulary"):
        sub.markov_weights()
    B, N, d = 2, draft.config.block_size, draft.config.backbone.hidden_size
    h = torch.randn(B, N, d, dtype=torch.float64)
    anchor, drafts = torch.tensor([5, -1]), ids[torch.randint(0, Vs, (B, N))]
    want = confidence_logits(draft, h, anchor, drafts)
    assert torch.equal(confidence_logits(sub, h, anchor, drafts), want) and want[1].eq(float("-inf")).all()


def test_greedy_speculative_generation_with_a_draft_vocabulary_equals_the_targets(tmp_path):
    pair, target, draft = _pair_models(seed=3)
    sub = _restricted(draft, torch.arange(0, V, 2))
    llm = LLM(pair, target, sub, max_batch_size=3, max_seq_len=96)
    rng = random.Random(0)
    prompts = [[rng.randrange(63) for _ in range(rng.randint(2, 9))] for _ in range(3)]
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    spec = llm.generate(prompts, sp, speculative=True)
    ar = llm.generate(prompts, sp, speculative=False)
    assert [s.output_ids for s in spec] == [a.output_ids for a in ar]
    assert any(t % 2 for s in ar for t in s.output_ids)        # the target does pick tokens outside the set
    assert sum(s.stats.tau for s in spec) / len(spec) > 1.0     # and the draft still gets some accepted


@pytest.mark.parametrize("name,head", [("qwen3-tiny-dspark", "lm_head"), ("deepseek-v4-tiny-dspark", "head")])
def test_preset_with_draft_vocab_file_generates_like_without_it(tmp_path, name, head):
    """``LLM.from_preset(draft_vocab=)``: the path through ``prepare_models``, greedy tokens equal
    (Qwen3 and DeepSeek-V4 drafts)."""
    from dspark_trt.config import get_preset
    Vt = get_preset(name).target.vocab_size
    path = tmp_path / "v.json"
    write_draft_vocab(path, torch.arange(0, Vt, 4), Vt, {})
    kw = dict(seed=0, dtype=torch.float32, device="cpu", max_batch_size=2, max_seq_len=64)
    sub = LLM.from_preset(name, draft_vocab=str(path), **kw)
    full = LLM.from_preset(name, **kw)
    assert getattr(sub.draft, head).weight.shape[0] == Vt // 4 and getattr(sub.target, head).weight.shape[0] == Vt
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = [[5, 17, 42, 99, 3], [7, 7, 300, 12]]
    assert [o.output_ids for o in sub.generate(prompts, sp)] == [o.output_ids for o in full.generate(prompts, sp)]


# ---- the commands ------------------------------------------------------------------------------

def test_draft_vocab_command_ranks_the_corpus_tokens_and_generate_reads_the_file(tmp_path, capsys):
    """``dspark-trt draft-vocab`` on the default pair's tokenizer: the most frequent ids of the
    texts, the coverage it prints, a file ``generate --draft-vocab`` runs with; a bad file is one
    error line naming it."""
    from dspark_trt.cli import main
    from dspark_trt.config.source import default_pair_dirs
    from dspark_trt.runtime.llm import load_tokenizer
    texts = tmp_path / "corpus.jsonl"
    lines = ["def f(x):\n    return x + 1\n"] * 20 + ["import os\nprint(os.getcwd())\n"] * 5
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    out = tmp_path / "v.json"
    assert main(["draft-vocab", "--texts", str(texts), "--size", "16", "--out", str(out)]) == 0
    assert "16 of 8192 tokens" in capsys.readouterr().out
    ids = read_draft_vocab(out, 8192)
    tok = load_tokenizer(default_pair_dirs()[0])
    counts = torch.zeros(8192, dtype=torch.long)
    for t in lines:
        counts += torch.bincount(torch.tensor(tok.encode(t).ids), minlength=8192)
    by_count = sorted((t for t in range(8192) if t != 0), key=lambda t: (-int(counts[t]), t))
    assert ids.tolist() == sorted([0] + by_count[:15])              # 0: the pair's eos id, always kept
    base = ["generate", "--device", "cpu", "--prompt", "def g(y):", "--max-new-tokens", "8"]
    text = lambda out: out.split("\n--- ")[0]                      # noqa: E731  (the stats follow)
    assert main(base + ["--draft-vocab", str(out)]) == 0
    with_vocab = text(capsys.readouterr().out)
    assert main(base) == 0
    assert with_vocab == text(capsys.readouterr().out) and with_vocab.startswith("def g(y):")   # greedy
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(base + ["--draft-vocab", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(bad) in err and err.count("\n") == 1


def test_draft_vocab_command_never_replaces_a_file_that_is_not_a_draft_vocabulary(tmp_path, capsys):
    """--out over a user's other file: one error line, the file untouched; over an older draft
    vocabulary: replaced."""
    from dspark_trt.cli import main
    texts = tmp_path / "c.txt"
    texts.write_text("def f(x):\n    return x\n")
    other = tmp_path / "config.json"
    other.write_text('{"vocab_size": 8192}')
    args = ["draft-vocab", "--texts", str(texts), "--size", "4", "--out"]
    assert main(args + [str(other)]) == 2
    assert "not a draft-vocabulary file" in capsys.readouterr().err
    assert other.read_text() == '{"vocab_size": 8192}'
    assert main(args + [str(tmp_path)]) == 2 and "is a directory" in capsys.readouterr().err
    vocab = tmp_path / "v.json"
    assert main(args + [str(vocab)]) == 0 and read_draft_vocab(vocab, 8192).numel() == 4
    assert main(args[:-2] + ["8", "--out", str(vocab)]) == 0 and read_draft_vocab(vocab, 8192).numel() == 8


def test_draft_vocab_command_refuses_bad_texts(tmp_path, capsys):
    from dspark_trt.cli import main
    texts = tmp_path / "c.jsonl"
    texts.write_text('{"text": "a"}\n{"body": "b"}\n')
    assert main(["draft-vocab", "--texts", str(texts), "--size", "4", "--out", str(tmp_path / "v.json")]) == 2
    err = capsys.readouterr().err
    assert f"{texts}:2" in err and "no string field" in err and not (tmp_path / "v.json").exists()


def test_confidence_rounds_write_the_full_z_into_the_callers_buffer():
    """``draft_block_confidence(..., z_out=)`` (the CUDA graphs' shared z buffer of confidence
    rounds) with a draft vocabulary: z [B, w, V] written into the buffer, equal to the call without
    it, and the confidence logits from the drafts' token ids; scheduled rounds stay lossless."""
    pair, target, draft = _pair_models(seed=4)
    draft.add_confidence_head()
    sub = _restricted(draft, torch.arange(0, V, 3))
    llm = LLM(pair, target, sub, max_batch_size=2, max_seq_len=64, page_size=8)
    nets = llm.networks
    table = torch.arange(2 * 4).view(2, 4)
    _, taps = nets.target(torch.tensor([[5, 9, 2, 7], [1, 3, 3, 8]]), torch.arange(4).repeat(2, 1), table)
    nets.draft_context(taps, torch.arange(4).repeat(2, 1), table)
    args = (torch.tensor([4, 6]), torch.tensor([4, 4]), table, torch.tensor([0.0, 0.9]), torch.tensor([3, 4]))
    want = nets.draft_block_confidence(*args, width=3)
    buf = torch.full((2, 3, V), float("nan"), dtype=torch.float32)
    got = nets.draft_block_confidence(*args, width=3, z_out=buf)
    assert got[1].data_ptr() == buf.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert torch.isin(got[0], torch.arange(0, V, 3)).all() and torch.isfinite(got[2]).all()
    sp = SamplingParams(max_new_tokens=16, ignore_eos=True, verify_mode="scheduled")
    prompts = [[5, 9, 2, 7], [1, 3, 3, 8, 11]]
    assert [o.output_ids for o in llm.generate(prompts, sp)] == \
        [o.output_ids for o in llm.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True),
                                            speculative=False)]


def test_tensor_parallel_runs_refuse_a_draft_vocabulary(tmp_path):
    """Under TP the draft's head is the target's vocabulary-parallel one: refused, naming why."""
    from types import SimpleNamespace
    from dspark_trt.checkpoints.prepare import apply_draft_vocab_
    _, _, draft = _pair_models()
    path = tmp_path / "v.json"
    write_draft_vocab(path, torch.arange(8), V, {})
    with pytest.raises(ConfigError, match="tensor parallelism"):
        apply_draft_vocab_(draft, str(path), SimpleNamespace(world=2))
    with pytest.raises(ConfigError, match="no draft"):
        apply_draft_vocab_(None, str(path))
    from dspark_trt.cli import main                                # the CLI: before anything loads
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["generate", "--model", "qwen3-tiny-dspark", "--device", "cpu", "--tp-size", "2",
                   "--draft-vocab", str(path), "--prompt-ids", "1"])
    assert rc == 2 and "--tp-size 2" in err.getvalue() and err.getvalue().count("\n") == 1
    apply_draft_vocab_(draft, str(path), SimpleNamespace(world=1))
    assert draft.lm_head.weight.shape[0] == 8
