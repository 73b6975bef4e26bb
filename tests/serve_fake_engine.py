"""A small deterministic stand-in for `ktrun.engine.Engine`, for the HTTP protocol tests of `ktrun serve`.

Run as a script it serves itself through the real server code (`ktrun.serve.run_server`):
    python tests/serve_fake_engine.py --port 0 [--api-key K] [--load-delay S] [--step-delay S]

Tokens are bytes (0..255) plus BOS=256, EOS=257. The next token is a function of the request's own sequence only
(so batching never changes it): a lowercase letter or space chosen by a hash of the last 4 tokens. Prompts with
special words steer it: "UTF8" -> emits 'é' (two bytes per character), "EOS" -> ends with EOS after 3 tokens,
"CRASH" -> the step that prefills it raises (an engine bug).
The engine checks that the engine thread never runs more than max_batch requests and never steps an aborted one.
"""
from __future__ import annotations

import argparse
import sys
import time
import zlib

from ktrun.sampling_params import SamplingParams

BOS, EOS = 256, 257


class ByteTokenizer:
    vocab_size = 258

    def encode(self, text, add_special_tokens=True):
        return ([BOS] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=False):
        text = "<s>" + "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return text + ("<|assistant|>" if add_generation_prompt else "")


def next_token(seq: list[int], n_generated: int) -> int:
    h = zlib.crc32(bytes(t & 0xFF for t in seq[-4:]) + bytes([n_generated & 0xFF]))
    return 32 if h % 6 == 0 else 97 + h % 26


class FakeEngine:
    def __init__(self, ctx=256, max_batch=16, step_delay=0.002, model_name="fake-model"):
        self.tokenizer, self.model_name, self.ctx, self.max_batch = ByteTokenizer(), model_name, ctx, max_batch
        self.step_delay = step_delay
        self._new: dict[str, tuple[list[int], SamplingParams]] = {}
        self._running: dict[str, dict] = {}
        self.stats = {"steps": 0, "max_batch_seen": 0, "aborts": 0, "cpu_expert_s": 0.0}

    def add_request(self, req_id, prompt_ids, params):
        if len(prompt_ids) > self.ctx:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds ctx {self.ctx}")
        if len(self._new) + len(self._running) >= self.max_batch:
            raise RuntimeError("fake engine: engine thread admitted more than max_batch requests")
        self._new[req_id] = (list(prompt_ids), params)

    def abort(self, req_id):
        self._new.pop(req_id, None)
        if self._running.pop(req_id, None) is not None:
            self.stats["aborts"] += 1

    def has_work(self):
        return bool(self._new or self._running)

    def step(self):
        time.sleep(self.step_delay)
        if any(b"CRASH" in bytes(t for t in ids if t < 256) for ids, _ in self._new.values()):
            self._new.clear()
            raise RuntimeError("fake engine: injected failure")
        for rid, (ids, params) in self._new.items():
            self._running[rid] = {"seq": ids, "n": 0, "params": params, "utf8": b"UTF8" in bytes(
                t for t in ids if t < 256), "eos": b"EOS" in bytes(t for t in ids if t < 256)}
        self._new.clear()
        self.stats["steps"] += 1
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(self._running))
        self.stats["cpu_expert_s"] += self.step_delay / 2
        out = []
        for rid, r in list(self._running.items()):
            if r["utf8"]:  # 'é' = C3 A9: every other token is half a character
                tok = 0xC3 if r["n"] % 2 == 0 else 0xA9
            elif r["eos"] and r["n"] == 3 and not r["params"].ignore_eos:
                tok = EOS
            else:
                tok = next_token(r["seq"], r["n"])
            r["seq"].append(tok)
            r["n"] += 1
            finish = "stop" if tok == EOS else ("length" if r["n"] >= r["params"].max_tokens
                                                or len(r["seq"]) >= self.ctx else None)
            out.append((rid, tok, finish))
            if finish:
                del self._running[rid]
        return out


def fake_generate(prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The tokens FakeEngine gives one request alone (the protocol tests' expected output)."""
    eng = FakeEngine(step_delay=0)
    eng.add_request("x", prompt_ids, SamplingParams(max_tokens=max_tokens))
    toks = []
    while eng.has_work():
        toks += [t for _, t, _ in eng.step()]
    return toks


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--api-key")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--load-delay", type=float, default=0.0)
    ap.add_argument("--step-delay", type=float, default=0.002)
    ap.add_argument("--max-body-bytes", type=int, default=1 << 16)
    a = ap.parse_args(argv)
    sys.path.insert(0, ".")
    from ktrun.serve import run_server

    def factory():
        time.sleep(a.load_delay)
        return FakeEngine(ctx=a.ctx, max_batch=a.max_batch, step_delay=a.step_delay)

    return run_server(factory, SamplingParams, port=a.port, api_key=a.api_key, max_batch=a.max_batch,
                      max_body_bytes=a.max_body_bytes)


if __name__ == "__main__":
    sys.exit(main())
