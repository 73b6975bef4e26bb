"""A small deterministic stand-in for `ktrun.engine.Engine`, for the HTTP protocol tests of `ktrun serve`.

Run as a script it serves itself through the real server code (`ktrun.serve.run_server`):
    python tests/serve_fake_engine.py --port 0 [--api-key K] [--load-delay S] [--step-delay S]

Tokens are bytes (0..255) plus BOS=256, EOS=257. The next token is a function of the request's own sequence only
(so batching never changes it): a lowercase letter or space chosen by a hash of the last 4 tokens. Prompts with
special words steer it: "UTF8" -> emits 'é' (two bytes per character), "EOS" -> ends with EOS after 3 tokens,
"CRASH" -> the step that prefills it raises (an engine bug), "SCRIPT:<text>" -> emits the bytes of <text> (up to the
end of its line; a backslash-n in it is a newline) one byte per token, then EOS: a scripted token stream for the
tool-call and reasoning parsers.
It honours n (choices), logprobs / prompt_logprobs (a fixed fake distribution per position in which the emitted
token is the most likely) and logits processors (the grammar of response_format picks among its preferences).
The engine checks that the engine loop never runs more than max_batch sequences and never steps an aborted one.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
import zlib
from types import SimpleNamespace

from ktrun.sampling_params import SamplingParams

BOS, EOS = 256, 257


class ByteTokenizer:
    vocab_size = 258

    def encode(self, text, add_special_tokens=True):
        return ([BOS] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=False, tools=None, enable_thinking=False):
        """A toy template: tool names after <s>; enable_thinking opens a think block in the generation prompt."""
        text = "<s>" + (f"<|tools|>{','.join(t['function']['name'] for t in tools)}\n" if tools else "")
        text += "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        return text + ("<|assistant|>" + ("<think>\n" if enable_thinking else "") if add_generation_prompt else "")


def fake_logprobs(seq: list[int], token: int, top_n: int):
    """A fixed distribution for the position after `seq` in which `token` is the most likely ->
    (logprob of token, [(id, logprob)] top_n best first)."""
    h = zlib.crc32(bytes(t & 0xFF for t in seq[-4:]))
    logits = [1.0 if t == token else -((t * 31 + h) % 17) / 4 for t in range(ByteTokenizer.vocab_size)]
    z = math.log(sum(math.exp(v) for v in logits))
    lp = [v - z for v in logits]
    top = sorted(range(len(lp)), key=lambda t: (-lp[t], t))[:top_n]
    return lp[token], [(t, lp[t]) for t in top]


def next_token(seq: list[int], n_generated: int) -> int:
    h = zlib.crc32(bytes(t & 0xFF for t in seq[-4:]) + bytes([n_generated & 0xFF]))
    return 32 if h % 6 == 0 else 97 + h % 26


class FakeEngine:
    def __init__(self, ctx=256, max_batch=16, step_delay=0.002, model_name="fake-model"):
        self.tokenizer, self.model_name, self.ctx, self.max_batch = ByteTokenizer(), model_name, ctx, max_batch
        self.step_delay = step_delay
        self.eos_ids = {EOS}
        self._new: dict[str, tuple[list[int], SamplingParams]] = {}
        self._running: dict[tuple[str, int], dict] = {}
        self.stats = {"steps": 0, "max_batch_seen": 0, "aborts": 0, "cpu_expert_s": 0.0}

    def add_request(self, req_id, prompt_ids, params):
        if len(prompt_ids) > self.ctx:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens exceeds ctx {self.ctx}")
        held = sum(p.n for _, p in self._new.values()) + len(self._running)
        if held + params.n > self.max_batch:
            raise RuntimeError("fake engine: engine loop admitted more than max_batch sequences")
        self._new[req_id] = (list(prompt_ids), params)

    def abort(self, req_id, index=None):
        self._new.pop(req_id, None)
        for key in [k for k in self._running if k[0] == req_id and index in (None, k[1])]:
            del self._running[key]
            self.stats["aborts"] += 1

    def has_work(self):
        return bool(self._new or self._running)

    def step(self):
        time.sleep(self.step_delay)
        if any(b"CRASH" in bytes(t for t in ids if t < 256) for ids, _ in self._new.values()):
            self._new.clear()
            raise RuntimeError("fake engine: injected failure")
        new = {}
        for rid, (ids, params) in self._new.items():
            text = bytes(t for t in ids if t < 256)
            script = None
            if b"SCRIPT:" in text:
                script = list(text.split(b"SCRIPT:", 1)[1].split(b"\n", 1)[0].replace(b"\\n", b"\n")) + [EOS]
            for i in range(params.n):
                new[rid, i] = {"seq": list(ids), "n": 0, "params": params, "utf8": b"UTF8" in text,
                               "eos": b"EOS" in text, "script": script, "first": True,
                               "procs": [make() for make in params.logits_processors]}
        self._running.update(new)
        self._new.clear()
        self.stats["steps"] += 1
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(self._running))
        self.stats["cpu_expert_s"] += self.step_delay / 2
        out = []
        for key, r in list(self._running.items()):
            if r["utf8"]:  # 'é' = C3 A9: every other token is half a character
                tok = 0xC3 if r["n"] % 2 == 0 else 0xA9
            elif r["script"] is not None:
                tok = r["script"][min(r["n"], len(r["script"]) - 1)]
            elif r["eos"] and r["n"] == 3 and not r["params"].ignore_eos:
                tok = EOS
            else:
                tok = next_token(r["seq"], r["n"] + key[1] * 7)
            if r["procs"]:
                tok = self._constrained(r, tok)
            p = r["params"]
            lp = None
            if p.logprobs is not None:
                chosen, top = fake_logprobs(r["seq"], tok, p.logprobs)
                lp = SimpleNamespace(token=tok, logprob=chosen, top=top)
            prompt_lp = None
            if r["first"] and p.prompt_logprobs is not None:
                ids = r["seq"]
                prompt_lp = [SimpleNamespace(token=ids[i], logprob=a, top=b) for i in range(1, len(ids))
                             for a, b in [fake_logprobs(ids[:i], ids[i], p.prompt_logprobs)]]
            r["first"] = False
            r["seq"].append(tok)
            r["n"] += 1
            finish = "stop" if tok == EOS or tok in p.stop_token_ids else ("length" if r["n"] >= p.max_tokens
                                                or len(r["seq"]) >= self.ctx else None)
            out.append(SimpleNamespace(req_id=key[0], token=tok, finish=finish, index=key[1], logprobs=lp,
                                       prompt_logprobs=prompt_lp))
            if finish:
                del self._running[key]
        return [FakeOutput(o) for o in out]

    def _constrained(self, r, preferred: int) -> int:
        """With logits processors: fake logits that prefer `preferred`, then a byte order of the rest."""
        import torch

        h = zlib.crc32(bytes(t & 0xFF for t in r["seq"][-4:]))
        logits = torch.tensor([-(((t * 31 + h) % 97) / 10) for t in range(ByteTokenizer.vocab_size)])
        logits[preferred] = 1.0
        generated = r["seq"][len(r["seq"]) - r["n"]:]
        for proc in r["procs"]:
            logits = proc(generated, logits)
        return int(torch.argmax(logits))


class FakeOutput(tuple):
    """(req_id, token, finish_reason) plus .index / .logprobs / .prompt_logprobs, as the Engine's StepOutput."""

    def __new__(cls, o):
        out = super().__new__(cls, (o.req_id, o.token, o.finish))
        out.index, out.logprobs, out.prompt_logprobs = o.index, o.logprobs, o.prompt_logprobs
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
    ap.add_argument("--tool-call-parser", default="none")
    ap.add_argument("--reasoning-parser", default="none")
    ap.add_argument("--reasoning-inline", action="store_true")
    limits = {"header-timeout": float, "body-timeout": float, "keep-alive-timeout": float, "max-header-bytes": int,
              "max-connections": int, "drain-timeout": float}     # run_server's defaults unless given
    for flag, kind in limits.items():
        ap.add_argument(f"--{flag}", type=kind)
    a = ap.parse_args(argv)
    sys.path.insert(0, ".")
    from ktrun.serve import run_server

    def factory():
        time.sleep(a.load_delay)
        return FakeEngine(ctx=a.ctx, max_batch=a.max_batch, step_delay=a.step_delay)

    return run_server(factory, SamplingParams, port=a.port, api_key=a.api_key, max_batch=a.max_batch,
                      max_body_bytes=a.max_body_bytes, tool_call_parser=a.tool_call_parser,
                      reasoning_parser=a.reasoning_parser, separate_reasoning=not a.reasoning_inline,
                      **{k.replace("-", "_"): getattr(a, k.replace("-", "_")) for k in limits
                         if getattr(a, k.replace("-", "_")) is not None})


if __name__ == "__main__":
    sys.exit(main())
