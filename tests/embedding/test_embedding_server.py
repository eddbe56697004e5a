"""The embedding server over real sockets: vectors against a reference computed here with
transformers and pooling written in the test, semantics, encodings, limits, batching."""

from __future__ import annotations

import base64
import struct
import threading

import httpx
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from harness.servers import ServerThread
from server.embedding.config import packaged_model_path
from tests.embedding.conftest import MODEL

TEXTS = [
    "The cat sits on the mat.",
    "A quick brown fox jumps over the lazy dog near the river bank at dawn.",
    "Paris is the capital of France.",
]


def reference_vectors(texts: list[str]) -> torch.Tensor:
    """all-MiniLM-L6-v2 as its card says: the transformer, mean over the attention mask, L2."""
    folder = packaged_model_path()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(mean, p=2, dim=1)


def embed(server: ServerThread, **body: object) -> httpx.Response:
    return server.http.post("/v1/embeddings", json={"model": MODEL, **body}, timeout=60)


def vectors_of(answer: httpx.Response) -> torch.Tensor:
    assert answer.status_code == 200, answer.text
    data = sorted(answer.json()["data"], key=lambda item: item["index"])
    return torch.tensor([item["embedding"] for item in data])


def test_vectors_match_the_reference(embedding_server: ServerThread) -> None:
    answer = embed(embedding_server, input=TEXTS)
    ours, reference = vectors_of(answer), reference_vectors(TEXTS)
    assert ours.shape == (3, 384)
    cosines = torch.nn.functional.cosine_similarity(ours, reference, dim=1)
    assert bool((cosines >= 0.9999).all()), cosines
    body = answer.json()
    assert body["object"] == "list" and body["model"] == MODEL
    tokenizer = AutoTokenizer.from_pretrained(packaged_model_path())
    num_tokens = sum(len(tokenizer(text)["input_ids"]) for text in TEXTS)
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}


def test_a_paraphrase_is_closer_than_an_unrelated_sentence(embedding_server: ServerThread) -> None:
    texts = [
        "How do I reset my password?",
        "What are the steps to change my login password?",
        "The stock market fell sharply on Tuesday.",
    ]
    anchor, paraphrase, unrelated = vectors_of(embed(embedding_server, input=texts))
    assert float(anchor @ paraphrase) > float(anchor @ unrelated) + 0.3


def test_token_ids_and_base64_give_the_same_vector(embedding_server: ServerThread) -> None:
    tokenizer = AutoTokenizer.from_pretrained(packaged_model_path())
    ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    by_text = vectors_of(embed(embedding_server, input=TEXTS[0]))
    by_ids = vectors_of(embed(embedding_server, input=ids))
    by_id_lists = vectors_of(embed(embedding_server, input=[ids, ids]))
    assert torch.allclose(by_text, by_ids, atol=1e-6)
    assert torch.allclose(by_id_lists, by_text.expand(2, -1), atol=1e-6)
    encoded = embed(embedding_server, input=TEXTS[0], encoding_format="base64").json()
    raw = base64.b64decode(encoded["data"][0]["embedding"])
    floats = torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert torch.allclose(floats, by_text[0], atol=1e-7)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": []}, 400, "input"),
        ({"input": ""}, 400, "input"),
        ({"input": [[]]}, 400, "input"),
        ({"input": 42}, 400, "input.str"),
        ({"input": [1.5]}, 400, "input.str"),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "x", "dimensions": 128}, 400, "dimensions"),
        ({"input": [[5, 40000]]}, 400, "input[0]"),
        ({"input": ["ok", "word " * 300]}, 400, "input[1]"),
        ({"input": ["x"] * 65}, 400, "input"),
        ({"input": "x", "model": "other"}, 404, "model"),
    ],
)
def test_bad_inputs_are_refused_naming_the_field(
    embedding_server: ServerThread, body: dict, status: int, param: str
) -> None:
    answer = embedding_server.http.post("/v1/embeddings", json={"model": MODEL, **body})
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param, answer.text


def test_truncation_only_when_asked_and_full_dimensions_accepted(
    embedding_server: ServerThread,
) -> None:
    long_text = "word " * 300
    assert embed(embedding_server, input=long_text).status_code == 400
    cut = embed(embedding_server, input=long_text, truncate_prompt_tokens=-1, dimensions=384)
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 256
    short = embed(embedding_server, input=long_text, truncate_prompt_tokens=10)
    assert short.json()["usage"]["prompt_tokens"] == 10


def test_requests_that_arrive_together_share_forward_passes(
    embedding_server: ServerThread,
) -> None:
    def batches() -> float:
        for line in embedding_server.http.get("/metrics").text.splitlines():
            if line.startswith("llm_embedding_batches_total "):
                return float(line.split()[1])
        raise AssertionError("no llm_embedding_batches_total")

    before = batches()
    answers: list[httpx.Response] = []
    threads = [
        threading.Thread(target=lambda i=i: answers.append(embed(embedding_server, input=f"n{i}")))
        for i in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [a.status_code for a in answers] == [200] * 8
    assert batches() - before < 8  # several requests per forward pass
    health = embedding_server.http.get("/health").json()
    assert health["kind"] == "embedding" and health["model"] == MODEL
    assert health["max_model_len"] == 256
