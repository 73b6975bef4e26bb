"""tiktoken.model (Kimi-K2 / K2.5's tokenizer) -> an exact `tokenizers` byte-level BPE (tokenizer.json).

tiktoken.model holds one `base64(token bytes) rank` line per token. Kimi ships it with tokenizer_config.json and a
Python tokenizer class (remote code, never run here) that adds the pre-tokenizer regex and 256 reserved special
tokens right after the base vocabulary (their contents from added_tokens_decoder, else <|reserved_token_ID|>).

tiktoken's encoder splits text with the regex, then per piece: the piece's own rank when it is a token, else BPE
that repeatedly joins the adjacent pair whose joined bytes have the lowest rank. The same as a `tokenizers` BPE
whose vocabulary is the ranks (bytes shown through the byte-level alphabet), `ignore_merges` (a whole-piece token
wins), and a merge list in rank order where each token's merge is the pair BPE reaches when it runs on that
token's bytes with ranks below the token's own (the pair that produces it). Special tokens are added tokens: matched
in the text before the regex runs, as the Kimi tokenizer's encode() allows all of them. No BOS or EOS is added.

Why not the tiktoken package at run time: the converted directory then holds one tokenizer.json that ktrun (and
any `tokenizers` user) reads with the same code as every other family; tests check the ids against tiktoken itself.
Only tokenizers whose regex ktrun knows are converted (the regex is not in the file).
"""
from __future__ import annotations

import base64
import json
from pathlib import Path

# Kimi-K2's pre-tokenizer split (tokenization_kimi.py's pat_str): Han runs; words with their leading
# non-letter/digit and an English contraction suffix (letter classes without Han, via class intersection); 1-3
# digits; punctuation runs with trailing newlines; newline runs; other whitespace.
_KIMI_ALTERNATIVES = (
    r"[\p{Han}]+",
    (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
     r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"),
    (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
     r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"),
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
)
KIMI_PATTERN = "|".join(_KIMI_ALTERNATIVES)
KIMI_N_SPECIAL = 256
# tokenizer_config.json tokenizer_class values whose tiktoken.model ktrun knows how to split (the Kimi tokenizer)
KNOWN_CLASSES = {"TikTokenTokenizer": KIMI_PATTERN}


class TiktokenError(ValueError):
    """A tiktoken.model that cannot be converted; the message names the file and line or field."""


def read_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken.model -> {token bytes: rank}; every line checked (base64, integer rank, no duplicates)."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(Path(path).read_text(encoding="ascii").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (IndexError, ValueError) as e:
            raise TiktokenError(f"{path}: line {n} is not 'base64 rank': {line[:60]!r} ({e})") from None
        if len(parts) != 2 or token in ranks:
            raise TiktokenError(f"{path}: line {n}: {'duplicate token' if token in ranks else 'extra fields'}")
        ranks[token] = rank
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TiktokenError(f"{path}: single byte {missing[0]:#04x} has no rank ({len(missing)} bytes missing): "
                            f"not a byte-level BPE")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TiktokenError(f"{path}: ranks are not 0..{len(ranks) - 1} without gaps or repeats")
    return ranks


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map (the alphabet of tokenizers' ByteLevel pre-tokenizer)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def _pair(ranks: dict[bytes, int], token: bytes, rank: int) -> tuple[bytes, bytes]:
    """The two parts BPE (ranks below `rank` only) leaves of `token`: the merge that produces it."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < rank and (best is None or r < best):
                best, at = r, i
        if best is None:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    if len(parts) != 2:
        raise TiktokenError(f"token {token!r} (rank {rank}) is not reachable by merging lower-ranked tokens")
    return parts[0], parts[1]


def special_tokens(n_base: int, tokenizer_config: dict, n_special: int = KIMI_N_SPECIAL) -> dict[int, str]:
    """id -> content of the reserved special tokens that follow the base vocabulary."""
    decoder = tokenizer_config.get("added_tokens_decoder") or {}
    named = {int(i): (t.get("content") if isinstance(t, dict) else str(t)) for i, t in decoder.items()}
    return {i: named.get(i, f"<|reserved_token_{i}|>") for i in range(n_base, n_base + n_special)}


def tokenizer_json(model_path: Path, tokenizer_config: dict, pattern: str | None = None) -> str:
    """tokenizer.json text equivalent to tiktoken.model + tokenizer_config.json. pattern None: by tokenizer_class
    (KNOWN_CLASSES); an unknown class is an error (its regex lives in remote code)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    if pattern is None:
        cls = tokenizer_config.get("tokenizer_class")
        pattern = KNOWN_CLASSES.get(cls)
        if pattern is None:
            raise TiktokenError(f"{model_path}: tokenizer_class {cls!r} in tokenizer_config.json: its pre-tokenizer "
                                f"regex lives in the model's remote code, which is never run; known tiktoken "
                                f"tokenizers: {', '.join(KNOWN_CLASSES)} (Kimi-K2 / K2.5)")
    ranks = read_ranks(model_path)
    alphabet = _byte_alphabet()

    def show(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    vocab = {show(t): r for t, r in by_rank}
    merges = [tuple(map(show, _pair(ranks, t, r))) for t, r in by_rank if len(t) > 1]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = special_tokens(len(ranks), tokenizer_config)
    tok.add_special_tokens([AddedToken(c, special=True, normalized=False) for _i, c in sorted(specials.items())])
    for i, c in specials.items():
        if tok.token_to_id(c) != i:
            raise TiktokenError(f"{model_path}: special token {c!r} would get id {tok.token_to_id(c)}, not {i} "
                                f"(a base token has the same text?)")
    return tok.to_str()


def tokenizer_files(model_dir: Path) -> dict[str, bytes]:
    """{"tokenizer.json": ...} for a directory with tiktoken.model and tokenizer_config.json but no tokenizer.json
    ({} when there is nothing to convert)."""
    d = Path(model_dir)
    if (d / "tokenizer.json").is_file() or not (d / "tiktoken.model").is_file():
        return {}
    cfg_path = d / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TiktokenError(f"{cfg_path}: not valid JSON ({e})") from None
    return {"tokenizer.json": tokenizer_json(d / "tiktoken.model", cfg).encode()}
