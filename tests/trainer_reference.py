"""A tiny BERT classifier, a word-level tokenizer and variable-length sentences: what the
drop-in Trainer is compared with transformers.Trainer on."""

from __future__ import annotations

import copy
import random

import torch

WORDS = [f"w{i}" for i in range(60)]


def tokenizer(tmp_path):
    """A BertTokenizer over a vocabulary written to tmp_path (no download)."""
    from transformers import BertTokenizer

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return BertTokenizer(str(vocab), model_max_length=64)


def classifier(seed=0, labels=3, **overrides):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        num_labels=labels, **overrides)
    return BertForSequenceClassification(config)


def sentences(tok, n, seed=0, shortest=3, longest=40, labels=3):
    """n tokenized sentences of random lengths (the collator pads each batch to its longest)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(shortest, longest)))
        item = dict(tok(text))
        item["labels"] = rng.randrange(labels)
        out.append(item)
    return out


def twin_models(seed=0, **overrides):
    model = classifier(seed, **overrides)
    return model, copy.deepcopy(model)


def logged(trainer, key="loss"):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def max_gap(model_a, model_b) -> float:
    return max((a.double() - b.double()).abs().max().item()
               for a, b in zip(model_a.state_dict().values(), model_b.state_dict().values())
               if a.is_floating_point())
