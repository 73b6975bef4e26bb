"""lm-evaluation-harness (the real `lm-eval` package) scoring the default model served by `ktrun serve`: a small
loglikelihood task (multiple choice) through `local-completions` (echo + logprobs, its remote tokenizer reading our
/tokenizer_info and /tokenize) and a small generate task through `local-chat-completions`; both task definitions
are local (a YAML file and a JSONL data file, nothing downloaded). The reference is the same evaluation with an
lm-eval model that scores in this process (the converted model's forward, no server): same scores, same
per-request loglikelihoods and generations."""
from __future__ import annotations

import json
import os

import pytest
import torch
from serve_helpers import ServerProcess

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.model import TemplateLM

BIN = __import__("pathlib").Path(__import__("sys").executable).parent
CTX = 512
MC = [  # the default model was trained on the Python standard library: these it can score
    {"question": "import os\nimport", "choices": [" sys", " banana", " 42"], "label": 0},
    {"question": "def __init__(self", "choices": ["):", " dog", "))))"], "label": 0},
    {"question": "for i in range(", "choices": ["10):", "cat", "]]]"], "label": 0},
    {"question": "if x is None:\n    return", "choices": [" None", " elephant", "!!"], "label": 0},
    {"question": "class Foo(", "choices": ["object):", "123", ";;"], "label": 0},
    {"question": "    raise ValueError(", "choices": ["'bad value')", "lambda", "import"], "label": 0},
]
GEN = [
    {"prompt": "Write a Python function `is_even(n)`: Return True if n is even.", "answer": "def is_even(n):"},
    {"prompt": "Write a Python function `read_lines(path)`: Read a file's lines.", "answer": "def read_lines(path):"},
    {"prompt": "Write a Python function `total(xs)`: Sum a list.", "answer": "def total(xs):"},
]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, rows in (("mc", MC), ("gen", GEN)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "ktrun_mc.yaml").write_text(f"""task: ktrun_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")
    (d / "ktrun_gen.yaml").write_text(f"""task: ktrun_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return d


@pytest.fixture(scope="module")
def server(default_converted):
    s = ServerProcess([str(BIN / "ktrun"), "serve", str(default_converted), "--port", "0", "--ctx", str(CTX)],
                      timeout=180)
    yield s
    assert s.stop() == 0, s.stderr
    assert "Traceback" not in s.stderr, s.stderr


class InProcessLM(TemplateLM):
    """lm-eval's model interface on the converted model in this process: prompt + continuation scored with one
    forward, generations from the Engine (greedy, the task's stop strings)."""

    def __init__(self, converted):
        super().__init__()
        from ktrun.engine import Engine

        self.engine = Engine(converted, ctx=CTX, max_batch=1)
        self.tok = self.engine.tokenizer

    @property
    def eot_token_id(self):
        return self.tok.eos_token_id

    @property
    def prefix_token_id(self):
        return self.tok.bos_token_id

    @property
    def tokenizer_name(self) -> str:
        return "ktrun-default"

    def tok_encode(self, string, **kwargs):
        return self.tok.encode(string, add_special_tokens=False)

    def apply_chat_template(self, chat_history, add_generation_prompt=True):
        return self.tok.render_chat(chat_history, add_generation_prompt=add_generation_prompt)

    def _loglikelihood_tokens(self, requests, **kwargs):
        from ktrun.models.kv_cache import Batch

        out = []
        for _, context_enc, continuation_enc in requests:
            ids = context_enc + continuation_enc
            cache = self.engine.model.new_cache(CTX)
            logits = self.engine.model.forward(Batch.build([(cache, ids)], self.engine.model.device),
                                               all_logits=True)
            lp = torch.log_softmax(logits[len(context_enc) - 1:-1], -1)            # rows predicting the continuation
            cont = torch.tensor(continuation_enc)
            out.append((float(lp.gather(1, cont[:, None]).sum()), bool((lp.argmax(-1) == cont).all())))
        return out

    def loglikelihood_rolling(self, requests, **kwargs):
        raise NotImplementedError

    def generate_until(self, requests, disable_tqdm: bool = False):
        from ktrun.engine import SamplingParams

        out = []
        for req in requests:
            context, gen_kwargs = req.args
            ids = self.tok.encode(context, add_special_tokens=False)
            self.engine.add_request("g", ids, SamplingParams(max_tokens=gen_kwargs.get("max_gen_toks", 16),
                                                             stop=list(gen_kwargs.get("until", []))))
            toks = []
            while self.engine.has_work():
                toks += [t for _, t, fin in self.engine.step() if fin is None or t not in self.engine.eos_ids]
            text = self.tok.decode(toks)
            for s in gen_kwargs.get("until", []):
                text = text.split(s)[0]
            out.append(text)
        return out


def _evaluate(model, model_args, tasks, task_names, chat: bool):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return simple_evaluate(model=model, model_args=model_args, tasks=task_names, log_samples=True,
                           task_manager=TaskManager(include_path=str(tasks)), apply_chat_template=chat,
                           bootstrap_iters=0)


def _per_sample(result, task):
    return [s["filtered_resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def test_lm_eval_scores_the_served_model_like_in_process(server, default_converted, tasks):
    name = default_converted.name
    served_ll = _evaluate("local-completions", f"model={name},base_url={server.base_url}/v1/completions,"
                          "num_concurrent=1,max_retries=1,tokenized_requests=True", tasks, ["ktrun_mc"], chat=False)
    served_gen = _evaluate("local-chat-completions", f"model={name},base_url={server.base_url}/v1/chat/completions,"
                           "num_concurrent=1,max_retries=1", tasks, ["ktrun_gen"], chat=True)
    ref = InProcessLM(default_converted)
    local_ll = _evaluate(ref, None, tasks, ["ktrun_mc"], chat=False)
    local_gen = _evaluate(ref, None, tasks, ["ktrun_gen"], chat=True)

    acc = served_ll["results"]["ktrun_mc"]["acc,none"]
    assert acc == local_ll["results"]["ktrun_mc"]["acc,none"] and acc >= 0.5, acc   # a trained model, not chance
    got, want = _per_sample(served_ll, "ktrun_mc"), _per_sample(local_ll, "ktrun_mc")
    assert len(got) == len(MC)
    for g, w in zip(got, want):
        assert [x[0] for x in g] == pytest.approx([x[0] for x in w], abs=2e-3)     # loglikelihood per choice
        assert [x[1] for x in g] == [x[1] for x in w]                               # is_greedy
    em = served_gen["results"]["ktrun_gen"]["exact_match,none"]
    assert em == local_gen["results"]["ktrun_gen"]["exact_match,none"]
    assert _per_sample(served_gen, "ktrun_gen") == _per_sample(local_gen, "ktrun_gen")
    assert all(r[0] for r in _per_sample(served_gen, "ktrun_gen"))                  # it did write something
