"""lm-eval's `local-completions` against a live server on the embedded model: a loglikelihood
task, a loglikelihood_rolling task and a generate_until task on tiny local JSON data, at batch
size 4 (lm-eval sends batched token-id prompts, `echo: true` for scoring). Every request is
answered 200, and lm-eval's loglikelihoods equal transformers' log_softmax on the same weights
and tokens (1e-4); its generations equal the engine's own greedy output."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models need its [api] extra

from lm_eval.tasks import TaskManager  # noqa: E402
from test_server import ServerThread  # noqa: E402

import nanoserve  # noqa: E402
from nanoserve import LLM, SamplingParams  # noqa: E402
from nanoserve.serve.app import build_app  # noqa: E402
from nanoserve.serve.async_engine import AsyncEngine  # noqa: E402

EMBEDDED = Path(nanoserve.__file__).parent / "assets" / "tiny-qwen3"
NAME = "tiny-qwen3"
ENGINE = dict(device="cpu", dtype="float32", page_size=16, max_num_batched_tokens=64,
              enable_prefix_caching=True)
DOCS = [
    {"question": "The secret number is 4821. The secret number is", "choices": [" 4821", " 1234"],
     "answer": 0, "text": "The grass is green and the sky is blue.", "until": "."},
    {"question": "Remember: the code is 77. The code is", "choices": [" 77", " 12", " 7"],
     "answer": 0, "text": "A haystack holds a needle; find it.", "until": "."},
    {"question": "One two three four", "choices": [" five", " six"], "answer": 0,
     "text": "Numbers count up: one, two, three.", "until": "."},
    {"question": "The sky is", "choices": [" blue", " green"], "answer": 0,
     "text": "Short.", "until": "."},
    {"question": "Red green", "choices": [" blue", " red"], "answer": 0,
     "text": "Another line of text, a little longer than the others here.", "until": "."},
]
TASKS = {
    "nano_mc": """
        output_type: multiple_choice
        doc_to_text: "{{question}}"
        doc_to_choice: "{{choices}}"
        doc_to_target: "{{answer}}"
        metric_list:
          - metric: acc
        """,
    "nano_rolling": """
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{text}}"
        metric_list:
          - metric: word_perplexity
        """,
    "nano_gen": """
        output_type: generate_until
        doc_to_text: "{{question}}"
        doc_to_target: "{{until}}"
        generation_kwargs:
          until: ["."]
          max_gen_toks: 12
        metric_list:
          - metric: exact_match
        """,
}


class StatusRecorder:
    """ASGI middleware that records every response's status."""

    def __init__(self, app) -> None:
        self.app, self.statuses = app, []

    async def __call__(self, scope, receive, send) -> None:
        async def record(message) -> None:
            if message["type"] == "http.response.start":
                self.statuses.append((scope.get("path"), message["status"]))
            await send(message)

        await self.app(scope, receive, record)


@pytest.fixture(scope="module")
def served():
    llm = LLM(progress=False, **ENGINE)
    ae = AsyncEngine(llm.engine)
    app = StatusRecorder(build_app(ae, NAME))
    srv = ServerThread(app)
    srv.app = app
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(EMBEDDED), dtype=torch.float32).eval()


def write_tasks(root: Path) -> None:
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    for name, body in TASKS.items():
        head = f"""
            task: {name}
            dataset_path: json
            dataset_kwargs:
              data_files:
                test: {data}
            test_split: test
            """
        (root / f"{name}.yaml").write_text(textwrap.dedent(head) + textwrap.dedent(body))


def logprob_sum(hf, context: list[int], continuation: list[int]) -> float:
    ids = context + continuation
    with torch.no_grad():
        lps = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return sum(lps[len(context) - 1 + i, t].item() for i, t in enumerate(continuation))


def test_lm_eval_local_completions_scores_and_generates(served, hf, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    write_tasks(tmp_path)
    model_args = {"model": NAME, "base_url": served.url + "/v1/completions",
                  "tokenizer_backend": "huggingface", "tokenizer": str(EMBEDDED),
                  "batch_size": 4, "max_length": 512, "max_retries": 1}
    results = lm_eval.simple_evaluate(
        model="local-completions", model_args=model_args, tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    completions = [s for p, s in served.app.statuses if p == "/v1/completions"]
    assert completions and all(s == 200 for s in completions), served.app.statuses
    lm = lm_eval.api.registry.get_model("local-completions")(**model_args)

    samples = results["samples"]
    assert len(samples["nano_mc"]) == len(DOCS)
    for sample in samples["nano_mc"]:
        assert len(sample["resps"]) == len(sample["doc"]["choices"])
        for ((ll, _greedy),), args in zip(sample["resps"], sample["arguments"], strict=True):
            context, continuation = lm._encode_pair(*args)  # as lm-eval tokenized them
            assert abs(ll - logprob_sum(hf, context, continuation)) < 1e-4

    for sample in samples["nano_rolling"]:
        tokens = lm.tok_encode(sample["doc"]["text"])
        ((ll,),) = sample["resps"]
        assert abs(ll - logprob_sum(hf, [lm.prefix_token_id], tokens)) < 1e-4

    ref = LLM(progress=False, **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, stop=["."])
    assert len(samples["nano_gen"]) == len(DOCS)
    for sample in samples["nano_gen"]:
        ids = lm.tok_encode(sample["doc"]["question"])
        ((text,),) = sample["resps"]
        assert text == ref.generate(ids, greedy)[0].text
