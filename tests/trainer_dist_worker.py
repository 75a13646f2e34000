"""A data-parallel fine-tuning run under torchrun (gloo, CPU): transformers.Trainer or the
drop-in, by argv[1]; rank 0 saves the final weights, the logged losses and the Step's stats to
argv[2]. Both runs see the same shards of the same batches."""

import gc
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import transformers  # noqa: E402
from transformers import DataCollatorWithPadding, TrainingArguments  # noqa: E402

from nimble_train.integrations import transformers as nt_transformers  # noqa: E402
from trainer_reference import logged, sentences, tokenizer, twin_models  # noqa: E402


def main(which: str, out: str) -> None:
    tmp = Path(tempfile.mkdtemp())
    tok = tokenizer(tmp)
    train = sentences(tok, 40, seed=6)
    model, _ = twin_models(seed=2 + int(os.environ["RANK"]))  # ranks start apart: rank 0 wins
    args = TrainingArguments(
        output_dir=str(tmp / "run"), per_device_train_batch_size=4,
        gradient_accumulation_steps=2, max_grad_norm=1.0, learning_rate=2e-3,
        lr_scheduler_type="linear", warmup_steps=1, num_train_epochs=2, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, seed=7, disable_tqdm=True)
    cls = nt_transformers.Trainer if which == "ours" else transformers.Trainer
    trainer = cls(model=model, args=args, train_dataset=train,
                  data_collator=DataCollatorWithPadding(tok))
    trainer.train()
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, weights)
    if int(os.environ["RANK"]) == 0:
        step = getattr(trainer, "nimble_step", None)
        torch.save({"weights": gathered, "losses": logged(trainer),
                    "stats": json.dumps(step.stats(), default=str) if step else None}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # Trainer leaves the process group it made to the interpreter's shutdown, where gloo's
    # threads may still run and abort the process; ended here (after the DDP wrapper that holds
    # it is gone), it ends cleanly.
    gc.collect()
    torch.distributed.destroy_process_group()
