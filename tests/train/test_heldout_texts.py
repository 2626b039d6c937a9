"""The default pair's frozen held-out texts (``train.heldout_texts``): the benchmarks' held-out
prompts come from them, the same on every machine, not from the running Python's stdlib."""
import gzip
import json

import pytest

from dspark_trt.train import corpus
from dspark_trt.train.heldout_texts import (HELDOUT_TEXTS, HeldoutTextsError, load_heldout_texts,
                                            write_heldout_texts)


def test_written_texts_load_as_the_stdlibs_heldout_files(tmp_path):
    path = tmp_path / "heldout.json.gz"
    rec = write_heldout_texts(path)
    _, held, man = corpus.read_stdlib(heldout=corpus.DEFAULT_PAIR_HELDOUT)
    assert load_heldout_texts(path) == [f.text for f in held]
    assert rec["heldout_sha256"] == man.heldout_sha256 and not list(tmp_path.glob("*.tmp*"))


def test_bad_texts_files_are_refused_by_name(tmp_path):
    with pytest.raises(HeldoutTextsError, match="missing"):
        load_heldout_texts(tmp_path / "absent.json.gz")
    path = tmp_path / "heldout.json.gz"
    rec = write_heldout_texts(path)
    rec["files"][1]["text"] += "# edited\n"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        json.dump(rec, fh)
    with pytest.raises(HeldoutTextsError, match=rec["files"][1]["module"].replace(".", r"\.") + " does not match"):
        load_heldout_texts(path)
    path.write_bytes(gzip.compress(b'{"files": [')[:-4])          # cut short
    with pytest.raises(HeldoutTextsError, match="not a held-out texts file"):
        load_heldout_texts(path)


def test_shipped_texts_are_the_training_runs_and_prompts_do_not_read_the_stdlib(monkeypatch):
    """The asset holds the H200 training run's Python (3.12) files, each checked by its sha256;
    ``make_prompts`` cuts the held-out prompts from them with no stdlib on the machine."""
    import torch
    from dspark_trt.commands.bench import make_prompts
    from dspark_trt.config.source import default_pair_dirs
    from dspark_trt.runtime.llm import LLM
    from dspark_trt.train.batches import encode_files, eval_prompts
    if default_pair_dirs() is None:
        pytest.skip("the built-in default pair is not in this checkout")
    with gzip.open(HELDOUT_TEXTS, "rt", encoding="utf-8") as fh:
        rec = json.load(fh)
    assert rec["python_version"].startswith("3.12.") and rec["heldout"] == list(corpus.DEFAULT_PAIR_HELDOUT)
    texts = load_heldout_texts()
    assert all(corpus.is_heldout(f["module"], corpus.DEFAULT_PAIR_HELDOUT) for f in rec["files"])

    def no_stdlib(*a, **k):
        raise AssertionError("read the running Python's stdlib")
    monkeypatch.setattr(corpus, "read_stdlib", no_stdlib)
    monkeypatch.setattr(corpus, "stdlib_dir", no_stdlib)
    llm = LLM.from_checkpoints(*default_pair_dirs(), dtype=torch.float32, device="cpu", max_batch_size=1,
                               max_seq_len=64)
    p = make_prompts(llm, "heldout", 4, 32, seed=0)
    assert p.tolist() == eval_prompts(encode_files(llm.tokenizer, texts), 4, 32, 32, seed=0)
