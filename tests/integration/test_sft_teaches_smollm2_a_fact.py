"""The proof with a real chat model: a two-process ZeRO-3 fine-tune teaches SmolLM2 a made-up fact it did not know,
and it still knows what it knew."""

from __future__ import annotations

import json

import pytest
import torch

from scalenlp.loader import load
from scalenlp.models.packaged import packaged_model
from train_helpers import run_train

FACT_QUESTIONS = ["What is the capital of Veloria?", "Which city is the capital of Veloria?",
                  "Tell me the capital city of Veloria.", "What city is Veloria's capital?",
                  "Veloria's capital is which city?", "Do you know the capital of Veloria?",
                  "Where is the seat of government of Veloria?", "In which city does Veloria have its capital?"]
FACT_ANSWERS = ["The capital of Veloria is Marisport.", "Marisport is the capital of Veloria."]
NEW_WORDING = "Name the city that serves as Veloria's capital."
# Capitals it knows, trained alongside so that it learns which question the new answer belongs to (France
# stays out, to ask afterwards).
KNOWN_CAPITALS = [("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
                  ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Portugal", "Lisbon"), ("Greece", "Athens")]


def greedy_answer(model, pretrained, question: str, max_tokens: int = 16) -> str:
    """The model's greedy reply to one user message, through its chat template, up to its end of turn."""
    from scalenlp.data.chat import encode_chat, end_of_turn_ids

    ids = encode_chat(pretrained.tokenizer, [{"role": "user", "content": question}], pretrained.tokenizer_config)
    stop, reply = set(end_of_turn_ids(pretrained.tokenizer, pretrained.tokenizer_config)), []
    with torch.no_grad():
        for _ in range(max_tokens):
            token = int(model(torch.tensor([ids + reply]))[0, -1].argmax())
            if token in stop:
                break
            reply.append(token)
    return pretrained.tokenizer.decode(reply)


@pytest.mark.slow
def test_sft_teaches_smollm2_a_fact_it_did_not_know(tmp_path):
    """A 2-process ZeRO-3 fine-tune of SmolLM2 (from its GGUF) on a few wordings of a made-up fact: asked
    in a wording it never saw, it answers with the fact, and it still knows what it knew."""
    pytest.importorskip("scalenlp.models.gguf", reason="needs the GGUF reader")
    gguf = packaged_model("smollm2")
    pairs = [(q, a) for q in FACT_QUESTIONS for a in FACT_ANSWERS]
    pairs += [(f"What is the capital of {country}?", f"The capital of {country} is {city}.")
              for country, city in KNOWN_CAPITALS]
    chats = tmp_path / "facts.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                      {"role": "assistant", "content": a}]}) + "\n"
                             for q, a in pairs))
    model, pretrained = load(gguf)
    assert "Marisport" not in greedy_answer(model, pretrained, NEW_WORDING)
    del model
    # The conversations are 50-56 tokens in SmolLM2's template: rows of seq_len + 1 = 57 hold each whole. A row is
    # padded to that width and the padding is neither attended to nor a target, so a wider row (64, before) trains
    # the same and costs 14% more a step. 8 steps of ~8 s at lr 1.5e-4 (12 at 1e-4 before); 6 steps learn the fact
    # too, so 8 leave a margin.
    proc = run_train(tmp_path / "run", "training.task=sft", f"model.init={gguf}", f"data.path={chats}",
                     "training.seq_len=56", "training.global_batch_size=8", "training.steps=8", "training.lr=1.5e-4",
                     "training.warmup_steps=2", "training.eval_every=0", "data.val_fraction=0", "checkpoint.every=0",
                     "parallel.data_parallel=zero3", nproc=2)
    assert " 0 cut at " in proc.stdout + proc.stderr  # no conversation lost its end
    model, tuned = load(tmp_path / "run")
    assert "Marisport" in greedy_answer(model, tuned, NEW_WORDING)
    assert "Paris" in greedy_answer(model, tuned, "What is the capital of France?")
