"""Training data for the embedded default model: the Python standard library's own source (PSF license).

Deterministic: sorted file list, every 20th file held out, a byte-level BPE tokenizer trained on the training split
only, plus chat-formatted samples (docstring -> function) so the chat template leads somewhere.
"""

from __future__ import annotations

import ast
import sysconfig
import textwrap
from pathlib import Path

import numpy as np

VOCAB_SIZE = 4096
HELDOUT_EVERY = 20  # file i is held out when i % 20 == 10 (sorted order)
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
SPECIAL_TOKENS = [BOS, EOS, PAD, USER, ASSISTANT]  # ids 0..4
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
EVAL_TOKENS = 4096  # predicted tokens in the fixed held-out slice the test checks
EVAL_TEXT_CHARS = 40000  # size of the shipped held-out text (heldout_eval.txt)
MAX_CHAT_SOURCE_CHARS = 1200

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)


def default_stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_files(stdlib: Path, limit: int = 0) -> tuple[list[Path], list[Path]]:
    """Top-level *.py files of the folder, sorted by name (the first `limit` if > 0); every 20th (offset 10) is
    held out."""
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    if len(files) < 2 * HELDOUT_EVERY:
        raise SystemExit(f"error: {stdlib} has only {len(files)} *.py files; need the Python standard library")
    if 0 < limit <= HELDOUT_EVERY // 2:
        raise SystemExit(f"error: --limit-files {limit} leaves no held-out file; use at least {HELDOUT_EVERY // 2 + 1}")
    files = files[:limit] if limit > 0 else files
    heldout = [p for i, p in enumerate(files) if i % HELDOUT_EVERY == HELDOUT_EVERY // 2]
    train = [p for i, p in enumerate(files) if i % HELDOUT_EVERY != HELDOUT_EVERY // 2]
    return train, heldout


def train_tokenizer(train_files: list[Path]):
    """Byte-level BPE (GPT-2 pre-tokenizer regex), BOS added by the post-processor (add_bos_token=True)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((p.read_text(encoding="utf-8") for p in train_files), trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, BOS_ID)])
    return tok


def chat_samples(train_files: list[Path]) -> list[str]:
    """'<User>Write a Python function `f(args)`: first docstring line<Assistant>source' for documented functions."""
    out = []
    for path in train_files:
        src = path.read_text(encoding="utf-8")
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            code = ast.get_source_segment(src, node)
            if not doc or not code or len(code) > MAX_CHAT_SOURCE_CHARS:
                continue
            first_line = doc.strip().splitlines()[0].strip()
            prompt = f"Write a Python function `{node.name}({ast.unparse(node.args)})`: {first_line}"
            # get_source_segment drops the first line's indentation only; re-indent it before dedenting.
            lines = code.splitlines()
            body = textwrap.dedent("\n".join([" " * node.col_offset + lines[0]] + lines[1:]))
            out.append(f"{USER}{prompt}{ASSISTANT}{body}\n")
    return out


def encode_stream(tok, texts: list[str], chats: list[str]) -> np.ndarray:
    """One token stream: BOS text EOS for every document (files first, then chat samples, in order)."""
    docs = list(texts) + list(chats)
    ids = [BOS_ID]
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.extend([EOS_ID, BOS_ID])
    return np.array(ids[:-1], dtype=np.int32)


def heldout_eval_text(heldout_files: list[Path]) -> str:
    """The fixed held-out slice shipped with the model: held-out files concatenated, cut on a line boundary."""
    text = "".join(p.read_text(encoding="utf-8") for p in heldout_files)
    return text[: text.rfind("\n", 0, EVAL_TEXT_CHARS) + 1]


def eval_windows(stream: np.ndarray, seq_len: int, max_tokens: int) -> np.ndarray:
    """Consecutive windows of seq_len+1 tokens (last token of one = first of the next): (n, seq_len+1)."""
    n = min((len(stream) - 1) // seq_len, max(1, max_tokens // seq_len))
    return np.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])


def unigram_ppl(train_counts: np.ndarray, tokens: np.ndarray) -> float:
    """Perplexity of an add-one-smoothed unigram model fitted on the training token counts."""
    p = (train_counts.astype(np.float64) + 1.0) / (train_counts.sum() + len(train_counts))
    return float(np.exp(-np.log(p[np.asarray(tokens).reshape(-1)]).mean()))
