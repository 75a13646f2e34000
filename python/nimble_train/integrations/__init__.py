"""Where users already train: a drop-in transformers.Trainer and a Lightning strategy."""
