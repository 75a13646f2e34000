"""One rank of tests/dist/test_launch.py: NCCL all-reduce, then nimble_train's kernel, per GPU."""

import os

import torch
import torch.distributed as dist

import nimble_train as nt
from nimble_train import _C


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        # Every rank runs the same NCCL as its torch, and the same build of nimble_train.
        assert _C.runtime_versions()["nccl"] == ".".join(map(str, torch.cuda.nccl.version()))
        versions = [None] * world
        dist.all_gather_object(versions, nt.build_info())
        assert all(v == versions[0] for v in versions), versions

        # Gradients are summed across ranks and averaged.
        grad = torch.full((1 << 16,), float(rank + 1), device=device)
        dist.all_reduce(grad)
        grad.div_(world)
        expected = (world + 1) / 2
        torch.testing.assert_close(grad, torch.full_like(grad, expected), rtol=0, atol=1e-6)
        print(f"rank {rank}/{world} ok", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
