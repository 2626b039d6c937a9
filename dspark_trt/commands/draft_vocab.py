"""``dspark-trt draft-vocab``: the draft's frequency-ranked sub-vocabulary from a text corpus.

Tokenizes ``--texts`` with the target's tokenizer, keeps the ``--size`` most frequent token ids
(with the end-of-sequence ids of config.json and generation_config.json) and writes the file ``--draft-vocab`` reads
(``models/draft_vocab.py``). Prints the share of the corpus's tokens the set covers: the draft
can propose only those, so its acceptance falls roughly where the target picks others.

Texts: ``.jsonl`` files (one JSON object a line, its "text" or "prompt"), else each file is one text.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..config import ConfigError

TEXT_KEYS = ("text", "prompt")
BATCH = 256


def add_parser(sub) -> None:
    p = sub.add_parser("draft-vocab", help="a frequency-ranked sub-vocabulary for the draft (--draft-vocab)")
    p.add_argument("--checkpoint", help="target checkpoint directory (its tokenizer.json and config.json; "
                                        "default: the built-in default pair's)")
    p.add_argument("--texts", nargs="+", required=True, metavar="FILE",
                   help="corpus files: .jsonl ('text' or 'prompt' a line) or plain text (one text a file)")
    p.add_argument("--size", type=int, required=True, help="tokens in the draft vocabulary")
    p.add_argument("--out", required=True, help="the draft-vocabulary file to write (JSON)")
    p.set_defaults(func=run)


def read_texts(path: Path) -> list[str]:
    """One file's texts; ``ConfigError`` naming the file and line that is not one."""
    try:
        raw = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--texts {path}: cannot read it ({e})") from None
    if path.suffix != ".jsonl":
        return [raw]
    out = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--texts {path}:{n}: not JSON ({e})") from None
        text = next((d[k] for k in TEXT_KEYS if isinstance(d, dict) and isinstance(d.get(k), str)), None)
        if text is None:
            raise ConfigError(f"--texts {path}:{n}: no string field {' or '.join(TEXT_KEYS)}")
        out.append(text)
    return out


def count_tokens(tokenizer, texts: list[str], vocab_size: int):
    """Token counts [V] int64 of ``texts``; ``ConfigError`` if the tokenizer gives ids past V."""
    import torch
    from ..progress import bar
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for i in bar(range(0, len(texts), BATCH), desc="tokenizing", unit="batch"):
        for enc in tokenizer.encode_batch(texts[i:i + BATCH]):
            ids = torch.tensor(enc.ids, dtype=torch.int64)
            if ids.numel() and int(ids.max()) >= vocab_size:
                raise ConfigError(f"the tokenizer gives token id {int(ids.max())}, the model's vocabulary "
                                  f"has {vocab_size}: tokenizer and config.json disagree")
            counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def write_draft_vocab(path, token_ids, vocab_size: int, source: dict) -> None:
    """The draft-vocabulary file of ``token_ids`` [Vs], written whole (``atomic_write``). An existing
    file is replaced only if it is a draft-vocabulary file: anything else there is the user's, and
    ``ConfigError`` says so before anything is written."""
    from ..atomic_write import write_text_atomic
    from ..models.draft_vocab import draft_vocab_json
    check_out(Path(path))
    write_text_atomic(Path(path), draft_vocab_json(token_ids, vocab_size, source))


def check_out(path: Path) -> None:
    """``--out`` may be new or a draft-vocabulary file (replaced), nothing else."""
    from ..models.draft_vocab import FORMAT
    if path.is_dir():
        raise ConfigError(f"--out {path}: is a directory; give the file to write")
    if path.exists():
        try:
            ours = json.loads(path.read_text()).get("format") == FORMAT
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise ConfigError(f"--out {path}: exists and is not a draft-vocabulary file; nothing was "
                              "written (choose another path)")


def as_list(ids) -> list[int]:
    """A config's ``eos_token_id`` (an int, a list or None) as a list."""
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


def run(args) -> int:
    from ..config.checks import read_json
    from ..config.source import default_pair_dirs
    from ..models.draft_vocab import rank_tokens
    from ..runtime.llm import load_tokenizer
    check_out(Path(args.out))                            # before the corpus is read
    ckpt = Path(args.checkpoint) if args.checkpoint else (default_pair_dirs() or (None,))[0]
    if ckpt is None:
        raise ConfigError("no --checkpoint and no built-in default pair")
    tokenizer = load_tokenizer(ckpt)
    if tokenizer is None:
        raise ConfigError(f"--checkpoint {ckpt}: no tokenizer.json")
    cfg = read_json(ckpt / "config.json")
    V = cfg.get("vocab_size")
    if not isinstance(V, int) or V <= 0:
        raise ConfigError(f"{ckpt / 'config.json'}: no positive vocab_size")
    gen = ckpt / "generation_config.json"   # either file's: Qwen3 runs stop on this one's, V4 on config.json's
    eos = [e for d in (cfg, read_json(gen) if gen.exists() else {}) for e in as_list(d.get("eos_token_id"))]
    texts = [t for f in args.texts for t in read_texts(Path(f))]
    counts = count_tokens(tokenizer, texts, V)
    ids = rank_tokens(counts, args.size, tuple(eos))
    total = int(counts.sum())
    coverage = float(counts[ids].sum()) / total if total else 0.0
    write_draft_vocab(args.out, ids, V, {"checkpoint": str(ckpt), "texts": [str(f) for f in args.texts],
                                         "corpus_tokens": total, "coverage": coverage})
    print(f"[dspark-trt] draft vocabulary: {ids.numel()} of {V} tokens, {coverage:.2%} of the corpus's "
          f"{total} tokens -> {args.out}")
    return 0
