"""Side-by-side benchmarks of a training step: ``python -m nimble_train.bench --help``.

Runs a recipe's model (ResNet-18, the branchy CIFAR network, BERT) in several modes in one
process, on the same GPU, data and seed: eager, eager with torch's fused optimizer,
torch.compile (default and reduce-overhead), the whole step captured by hand, and nt.Step
(one stream, streams="auto"). It prints a table and writes it as JSON and a PNG chart.

- ``timing``: CUDA-event medians, time to the first fast step, GPU-busy fraction, overlap;
- ``workloads``: the recipes' models, optimizers and synthetic data (shared with recipes/);
- ``modes``: the ways of running a step; ``report``: table, JSON and chart; ``cli``: main().
"""

from .cli import main, run
from .modes import MODES
from .report import add_ratios, format_table, plot, write_all, write_json
from .timing import (Overlap, alternating_ms, busy_fraction, busy_time, gpu_activity,
                     gpu_busy_fraction, ms_per_step, overlap, profile_overlap,
                     time_to_first_fast_step)

__all__ = [
    "MODES", "Overlap", "add_ratios", "alternating_ms", "busy_fraction", "busy_time",
    "format_table", "gpu_activity", "gpu_busy_fraction", "main", "ms_per_step", "overlap", "plot",
    "profile_overlap", "run", "time_to_first_fast_step", "write_all", "write_json",
]
