"""Variable-length batches, masked models and the eager references shape buckets are compared
against (the eager loop on the unpadded batches, an eager no_grad evaluation)."""

import torch
import torch.nn.functional as F

VOCAB = 50


class MaskedPool(torch.nn.Module):
    """Token embeddings, a per-token layer, a mean over the real tokens (attention_mask 1) and
    a classifier: padded positions change nothing when masked."""

    def __init__(self, dim=16, classes=3, vocab=VOCAB):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, input_ids, attention_mask, labels=None):
        h = self.norm(torch.tanh(self.mix(self.emb(input_ids))))
        mask = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * mask).sum(1) / mask.sum(1)
        return self.head(pooled)


class TokenTagger(torch.nn.Module):
    """A per-token classifier over a tuple batch ((ids, mask), token labels): -100 labels (the
    padding) are ignored by the loss."""

    def __init__(self, dim=16, classes=4, vocab=VOCAB):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.mix = torch.nn.Linear(2 * dim, dim)
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, ids, mask):
        h = self.emb(ids)
        m = mask.unsqueeze(-1).to(h.dtype)
        context = (h * m).sum(1, keepdim=True) / m.sum(1, keepdim=True)  # masked sequence mean
        h = torch.relu(self.mix(torch.cat([h, context.expand_as(h)], dim=-1)))
        return self.head(h)


def sample_losses(logits, batch):
    return F.cross_entropy(logits, batch["labels"], reduction="none")


def token_loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def lengths_batch(lengths, *, classes=3, vocab=VOCAB, device="cpu", generator=None):
    """A dict batch dynamically padded to its longest sequence: ids 0 and mask 0 past each
    sequence's length, one label per sequence."""
    g = generator
    rows, longest = len(lengths), max(lengths)
    ids = torch.randint(1, vocab, (rows, longest), generator=g)
    mask = torch.zeros(rows, longest, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    ids = ids * mask
    labels = torch.randint(0, classes, (rows,), generator=g)
    return {k: v.to(device) for k, v in
            {"input_ids": ids, "attention_mask": mask, "labels": labels}.items()}


def variable_batches(count, rows, max_len, *, seed=0, device="cpu", classes=3, vocab=VOCAB,
                     short_at=()):
    """`count` dict batches of random lengths in [1, max_len]; batches at `short_at` have one
    row fewer (a short last batch)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        n = rows - 1 if i in short_at else rows
        lengths = torch.randint(1, max_len + 1, (n,), generator=g).tolist()
        out.append(lengths_batch(lengths, classes=classes, vocab=vocab, device=device,
                                 generator=g))
    return out


def token_batches(count, rows, max_len, *, seed=0, device="cpu", classes=4):
    """Tuple batches ((ids, mask), labels) with -100 labels on padding."""
    out = []
    for b in variable_batches(count, rows, max_len, seed=seed, device=device):
        mask = b["attention_mask"]
        g = torch.Generator().manual_seed(seed + len(out))
        labels = torch.randint(0, classes, mask.shape, generator=g).to(mask.device)
        labels = torch.where(mask.bool(), labels, -100)
        out.append(((b["input_ids"], mask), labels))
    return out


def tiny_bert(task="classify", *, device="cpu", seed=0, **overrides):
    """A tiny Hugging Face BERT from a config (nothing downloaded), dropout off, pad id 0."""
    import transformers
    torch.manual_seed(seed)
    options = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=64, max_position_embeddings=128, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0, pad_token_id=0, num_labels=3)
    config = transformers.BertConfig(**{**options, **overrides})
    cls = (transformers.BertForSequenceClassification if task == "classify"
           else transformers.BertForMaskedLM)
    return cls(config).to(device)


def mlm_batches(count, rows, max_len, *, seed=0, device="cpu"):
    """Masked-LM batches: labels are the token where 20% of real positions are chosen, -100
    elsewhere (padding included)."""
    out = []
    g = torch.Generator().manual_seed(seed)
    for b in variable_batches(count, rows, max_len, seed=seed, device=device):
        chosen = (torch.rand(b["input_ids"].shape, generator=g) < 0.2).to(device)
        chosen &= b["attention_mask"].bool()
        chosen[:, 0] = True  # at least one label per row
        out.append({"input_ids": b["input_ids"], "attention_mask": b["attention_mask"],
                    "labels": torch.where(chosen, b["input_ids"], -100)})
    return out


def eager_own_loss_loop(model, optimizer, batches):
    """The plain loop for a model that computes its own loss (Hugging Face)."""
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def correct_and_loss(model, batch):
    """An evaluation function: correct predictions and the summed loss of a classifier."""
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits = getattr(out, "logits", out)
    return {"correct": (logits.argmax(-1) == batch["labels"]).sum(),
            "loss_sum": F.cross_entropy(logits.float(), batch["labels"], reduction="sum")}


def eager_evaluation(model, batches):
    """correct_and_loss summed over `batches` in eval mode without autograd, as a user writes
    it, then the modes restored."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    with torch.no_grad():
        outs = [correct_and_loss(model, b) for b in batches]
    for m, training in modes:
        m.training = training
    return {k: sum(o[k] for o in outs) for k in outs[0]}
