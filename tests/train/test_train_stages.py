"""The staged training run (#18) end to end on a toy corpus: splits, self-distilled data, equal
draft steps, best-checkpoint selection, resume, shard sizes. Corpus roots are copies of a few
stdlib files (always present), never the installed packages."""
import dataclasses
import json
import shutil

import pytest
import torch
from torch import nn

from dspark_trt.train import checkpoints
from dspark_trt.train.best import BestCheckpoint
from dspark_trt.train.corpus import stdlib_dir
from dspark_trt.train.dense import causal_lm_forward
from dspark_trt.train.distill import DistillSet
from dspark_trt.train.objective import sample_masked_anchors
from dspark_trt.train.recipe import get_recipe
from dspark_trt.train.sources import (SPLITS, CorpusError, Manifest, SplitSpec, read_texts, scan,
                                      split_of, unit_of)
from dspark_trt.train.stages import DRAFTS, StageError, run_stages

STD_FILES = ["bisect.py", "colorsys.py", "keyword.py", "glob.py", "fnmatch.py", "shlex.py",
             "textwrap.py", "heapq.py", "string.py", "base64.py", "copy.py", "calendar.py",
             "csv.py", "difflib.py", "fractions.py", "pprint.py", "statistics.py", "json/__init__.py",
             "json/decoder.py", "json/encoder.py", "json/scanner.py", "json/tool.py"]


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("roots")
    for rel in STD_FILES:
        (base / "std" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(stdlib_dir() / rel, base / "std" / rel)
    pkg = base / "pkg"
    for i in range(6):
        (pkg / f"mod{i}").mkdir(parents=True)
        (pkg / f"mod{i}" / "__init__.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 30)
    (pkg / "huge.py").write_text("x = 1\n" * 100_000)                  # over max_file_bytes
    return {"std": base / "std", "pkg": pkg}


SPEC = SplitSpec(eval_frac=0.3, distill_frac=0.3)


def test_split_is_deterministic_disjoint_and_by_unit(roots):
    a, b = scan(roots, SPEC), scan(roots, SPEC)
    assert a.files == b.files and a.sha256() == b.sha256()
    keys = {s: {(f["root"], f["path"]) for f in a.by_split(s)} for s in SPLITS}
    assert sum(len(k) for k in keys.values()) == len(a.files)                  # disjoint, complete
    assert all(keys[s] for s in SPLITS)
    by_unit = {}
    for f in a.files:
        by_unit.setdefault(unit_of(f["root"], f["path"], SPEC.unit_depth), set()).add(f["split"])
    assert all(len(s) == 1 for s in by_unit.values())                           # a unit stays whole
    assert len({f["split"] for f in a.files if f["path"].startswith("json/")}) == 1
    assert any("huge.py" in s for s in a.skipped)
    # a file's split does not depend on which other roots/files exist (machines differ)
    only_std = scan({"std": roots["std"]}, SplitSpec(eval_frac=0.3, distill_frac=0.3))
    where = {(f["root"], f["path"]): f["split"] for f in a.files}
    assert all(where[(f["root"], f["path"])] == f["split"] for f in only_std.files)
    # another seed moves units
    other = [split_of(u, dataclasses.replace(SPEC, seed=1)) for u in by_unit]
    assert other != [split_of(u, SPEC) for u in by_unit]


def test_manifest_roundtrip_and_changed_file_is_refused(roots, tmp_path):
    man = scan(roots, SPEC)
    back = Manifest.from_json(man.to_json())
    assert back.files == man.files and back.sha256("eval") == man.sha256("eval")
    assert len(read_texts(back, "eval")) == len(man.by_split("eval"))
    f = man.by_split("eval")[0]
    copy = tmp_path / "copy"
    shutil.copytree(roots[f["root"]], copy)
    (copy / f["path"]).write_text("changed\n")
    back.roots[f["root"]] = str(copy)
    with pytest.raises(CorpusError, match="sha256"):
        read_texts(back, "eval")


def test_masked_anchors_only_where_labels_are():
    mask = torch.zeros(3, 20, dtype=torch.bool)
    mask[0, 5:12] = True          # 7 generated tokens -> anchors 4..10
    mask[1, 15:20] = True         # 5 -> anchors 14..18
    g = torch.Generator().manual_seed(0)
    anchors, ok = sample_masked_anchors(mask, 6, g)
    assert anchors.shape == (3, 6)
    for b in range(3):
        got = anchors[b][ok[b]].tolist()
        allowed = [a for a in range(19) if mask[b, a + 1]]
        assert set(got) <= set(allowed) and len(got) == min(6, len(allowed))
        assert got == sorted(got) and len(set(got)) == len(got)
    assert not ok[2].any()


def test_best_checkpoint_restores_the_minimum():
    m = nn.Linear(2, 2)
    best = BestCheckpoint(m, "ce")
    seen = {}
    for step, ce in [(10, 3.0), (20, 2.0), (30, 2.5), (40, 2.0), (50, 4.0)]:
        with torch.no_grad():
            m.weight.fill_(float(step))
        best.update(step, {"ce": ce})
        seen[step] = m.weight.clone()
    assert best.restore() == 20 and best.best_value == 2.0        # first of the tied minima
    assert torch.equal(m.weight, seen[20])


@pytest.fixture(scope="module")
def run_dir(roots, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    log = []
    run_stages(get_recipe("smoke"), out, ["target"], device="cpu", roots=roots, log=log.append)
    mtime = (out / "target" / "config.json").stat().st_mtime_ns
    run_stages(get_recipe("smoke"), out, ["all"], device="cpu", roots=roots, log=log.append)
    return out, log, mtime


def test_resume_skips_finished_stages(run_dir, roots):
    out, log, mtime = run_dir
    assert "[train] stage target: done already, skipped" in log
    assert (out / "target" / "config.json").stat().st_mtime_ns == mtime
    state = json.loads((out / "stages.json").read_text())
    assert set(state["done"]) >= {"target", "distill", "drafts", "eval"}
    # a drafts stage cut short after DSpark: only the missing drafts train again
    for k in ("drafts", "drafts.dflash", "drafts.ar_draft"):
        state["done"].pop(k)
    (out / "stages.json").write_text(json.dumps(state))
    dspark_mtime = (out / "draft" / "config.json").stat().st_mtime_ns
    log2 = []
    run_stages(get_recipe("smoke"), out, ["all"], device="cpu", roots=roots, log=log2.append)
    assert (out / "draft" / "config.json").stat().st_mtime_ns == dspark_mtime
    assert any(m.startswith("[train] dspark: done already") for m in log2)
    assert any(m.startswith("[train] dflash step") for m in log2)
    assert "[train] stage eval: done already, skipped" in log2
    other = dataclasses.replace(get_recipe("smoke"), seed=5)
    with pytest.raises(StageError, match="stage target was run with another recipe"):
        run_stages(other, out, ["all"], device="cpu", roots=roots, log=log2.append)
    longer = dataclasses.replace(get_recipe("smoke"), drafts=dataclasses.replace(
        get_recipe("smoke").drafts, steps=5))
    with pytest.raises(StageError, match="stage drafts"):
        run_stages(longer, out, ["all"], device="cpu", roots=roots, log=log2.append)


def test_draft_steps_may_change_until_the_drafts_train(run_dir, roots, tmp_path):
    src, _, _ = run_dir
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    state = json.loads((out / "stages.json").read_text())
    state["done"] = {k: v for k, v in state["done"].items() if k in ("target", "distill")}
    (out / "stages.json").write_text(json.dumps(state))
    r = get_recipe("smoke")
    longer = dataclasses.replace(r, drafts=dataclasses.replace(r.drafts, steps=r.drafts.steps + 2))
    run_stages(longer, out, ["drafts"], device="cpu", roots=roots, log=lambda m: None)
    steps = {json.loads((out / f"history_{n}.json").read_text())["total_steps"] for n in DRAFTS}
    assert steps == {r.drafts.steps + 2}


def test_distilled_labels_are_exactly_the_generated_tokens(run_dir):
    out, _, _ = run_dir
    r = get_recipe("smoke")
    ds = DistillSet.load(out / "distill" / "train.pt")
    assert ds.tokens.shape[0] == r.distill.num_prompts
    assert int(ds.greedy.sum()) == round(r.distill.greedy_frac * r.distill.num_prompts)
    target = checkpoints.load_target(out / "target")
    for i in range(ds.tokens.shape[0]):
        p = int(ds.prompt_len[i])
        idx = ds.label_mask[i].nonzero().flatten().tolist()
        assert idx[0] == p and idx == list(range(p, p + len(idx)))    # contiguous after prompt
        assert 1 <= len(idx) <= r.distill.new_tokens
        if bool(ds.greedy[i]):        # greedy rows: the target's own argmax continuation
            seq = ds.tokens[i, :p + len(idx)].long()[None]
            logits, _ = causal_lm_forward(target, seq)
            assert torch.equal(logits[0, p - 1:-1].argmax(-1), seq[0, p:])


def test_drafts_train_equal_steps_and_shards_fit(run_dir):
    out, _, _ = run_dir
    r = get_recipe("smoke")
    steps = {n: json.loads((out / f"history_{n}.json").read_text())["total_steps"] for n in DRAFTS}
    assert set(steps.values()) == {r.drafts.steps}
    hist = json.loads((out / "history_target.json").read_text())
    ce = [e["ce"] for e in hist["eval"]]
    assert hist["best_step"] == hist["eval_steps"][ce.index(min(ce))]
    for sub in ("target",) + tuple(DRAFTS.values()):
        assert checkpoints.check_shards(out / sub)
    ev = json.loads((out / "eval.json").read_text())
    assert set(ev["teacher_forced"]) == set(DRAFTS)
    assert all(1 <= v["tau_t0"] <= r.block_size + 1 for v in ev["teacher_forced"].values())
    assert all(v["greedy_equals_target"] == ev["prompts"]
               for k, v in ev["runtime"].items() if k.endswith("T0"))


def test_sharded_save_splits_and_reloads(run_dir, tmp_path):
    out, _, _ = run_dir
    target = checkpoints.load_target(out / "target")
    limit = 40_000
    checkpoints.save_target(tmp_path / "t", target, (out / "tokenizer.json").read_text(),
                            shard=limit - 4096)
    files = checkpoints.check_shards(tmp_path / "t", limit)
    assert len(files) > 1
    again = checkpoints.load_target(tmp_path / "t")
    for (n, a), b in zip(target.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), n
    with pytest.raises(ValueError, match="over"):
        checkpoints.check_shards(tmp_path / "t", 1000)


def test_default_recipe_fits_the_shipping_budget():
    """h200 preset: target + DSpark draft in bf16 <= 60 MB, every tensor fits one shard."""
    from dspark_trt.checkpoints.qwen3 import qwen3_draft_tensors, qwen3_target_tensors
    from dspark_trt.train.modules import build_block_draft, build_target
    r = get_recipe("h200")
    with torch.device("meta"):
        target = build_target(r, "meta", 0)
        draft = build_block_draft(r, target, r.markov_rank, 1)
    tensors = list(qwen3_target_tensors(target).values()) + list(
        qwen3_draft_tensors(draft, include_shared=False).values())
    sizes = [t.numel() * 2 for t in tensors]
    assert sum(sizes) <= 60e6 and max(sizes) <= checkpoints.SHARD_BYTES
    assert r.dspark.steps == r.dflash.steps == r.ar.steps == r.drafts.steps


def test_confidence_head_learns_the_acceptance_target(run_dir):
    """BCE towards c* = 1 - ½‖p_d - p_t‖₁: a few steps on the head alone shrink |c - c*|; the
    trained head is saved beside the DSpark draft (outside the index the runtime reads)."""
    from dspark_trt.train.confidence import ConfidenceHead, confidence_loss, load_confidence
    out, _, _ = run_dir
    r = get_recipe("smoke")
    saved = load_confidence(out / "draft", r, "cpu")
    assert saved is not None and saved.proj.weight.shape == (1, r.hidden_size + r.markov_rank)
    assert "confidence" not in (out / "draft" / "model.safetensors.index.json").read_text()
    g = torch.Generator().manual_seed(0)
    h, w1 = torch.randn(4, 3, 7, 16, generator=g), torch.randn(4, 3, 7, 8, generator=g)
    target = torch.sigmoid(h[..., :2].sum(-1) - w1[..., 0])                   # learnable c*
    w = torch.ones(4, 3, 7)
    head = ConfidenceHead(16, 8)
    opt = torch.optim.Adam(head.parameters(), lr=0.05)
    first = confidence_loss(head(h, w1), target, w)["abs_err"].item()
    for _ in range(60):
        loss = confidence_loss(head(h, w1), target, w)["bce"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert confidence_loss(head(h, w1), target, w)["abs_err"].item() < 0.5 * first


def test_no_stage_or_draft_starts_after_the_budget(run_dir, roots, tmp_path):
    import time
    from dspark_trt.train.pipeline import Run
    from dspark_trt.train.stages import OutOfTime, RunDir, stage_drafts
    src, _, _ = run_dir
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    state = json.loads((out / "stages.json").read_text())
    for k in ("drafts", "drafts.dspark", "drafts.dflash", "drafts.ar_draft", "eval"):
        state["done"].pop(k, None)
    (out / "stages.json").write_text(json.dumps(state))
    log = []
    run_stages(get_recipe("smoke"), out, ["all"], device="cpu", roots=roots, minutes=-1,
               log=log.append)
    assert any("no time left" in m for m in log)
    assert "drafts" not in json.loads((out / "stages.json").read_text())["done"]
    rd = RunDir(out, get_recipe("smoke"))
    with pytest.raises(OutOfTime):
        stage_drafts(rd, Run(rd.r, "cpu", False, log.append), deadline=time.time() - 1)
    assert not any(k.startswith("drafts") for k in rd.state["done"])
