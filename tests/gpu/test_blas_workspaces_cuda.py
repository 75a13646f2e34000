"""A captured step keeps the cuBLAS workspaces its graphs use (src/capture/blas_workspaces.h):
when torch frees its own (torch._C._cuda_clearCublasWorkspaces, which reduce-overhead's
cudagraph trees call around every warm-up and recording), a live Step neither writes into
memory handed to other tensors nor reads memory returned to the driver, and trains as the
eager loop. Each scenario runs in a process of its own: before the fix one wrote over other
tensors or ended in an illegal memory access, which would take the test process down."""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import nimble_train as nt

pytestmark = pytest.mark.cuda

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = textwrap.dedent("""
    import copy, torch
    import nimble_train as nt
    from step_reference import assert_same_training

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(),
                                torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                                torch.nn.Linear(2048, 10)).cuda()
    twin = copy.deepcopy(model)
    make = lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    opt, twin_opt = make(model), make(twin)
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(256, 512, generator=g).cuda(),
                torch.randint(0, 10, (256,), generator=g).cuda()) for _ in range(4)]
    step = nt.Step(model, opt, loss_fn)

    def both(n, start=0):
        for i in range(start, start + n):
            x, y = batches[i % len(batches)]
            step((x, y))
            twin_opt.zero_grad()
            loss_fn(twin(x), y).backward()
            twin_opt.step()

    both(step.stats()["warmup_left"] + 2)
    assert step.stats()["captured"], step.stats()
    assert step._graph.graph.blas_workspaces >= 1
""")

AFTER = textwrap.dedent("""
    junk = [torch.full((4 << 20,), 7.0, device="cuda") for _ in range(32)]
    both(20, start=1)
    torch.cuda.synchronize()
    overwritten = sum(int((j != 7.0).sum()) for j in junk)
    assert overwritten == 0, f"the step's graph wrote {overwritten} elements of other tensors"
    assert_same_training(model, opt, twin, twin_opt, rtol=1e-4, atol=1e-5)
    print("OK")
""")


def run_script(script: str) -> None:
    """Runs `script` in a Python process of its own, which must print OK last."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
    ran = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=600)
    assert ran.returncode == 0 and ran.stdout.strip().endswith("OK"), (
        f"exit {ran.returncode}\n{ran.stdout[-3000:]}\n{ran.stderr[-3000:]}")


def run(scenario: str) -> None:
    run_script(PRELUDE + scenario + AFTER)


def test_a_live_step_survives_torch_clearing_its_cublas_workspaces():
    run(textwrap.dedent("""
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()  # what was freed goes back to the driver
    """))


def test_a_live_step_survives_a_reduce_overhead_model_in_the_same_process():
    run(textwrap.dedent("""
        other = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 512)).cuda()
        fast = torch.compile(other, mode="reduce-overhead")
        x = torch.randn(64, 512, device="cuda")
        with torch.no_grad():
            for _ in range(4):  # warm-up, recording, replays: around each, the clearing
                out = fast(x).clone()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    """))


def test_the_graphs_of_one_step_share_its_workspaces():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 5)).cuda()
    batches = [(torch.randn(32, 64, device="cuda"), torch.randint(0, 5, (32,), device="cuda"))
               for _ in range(4)]
    step = nt.Step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                   torch.nn.CrossEntropyLoss(), accumulate=2)
    for i in range(16):
        step(batches[i % 4])
    torch.cuda.synchronize()
    graph = step._graph.graph
    captured = sum(graph.captured(e) for e in range(graph.num_entries))
    assert captured >= 2  # the micro-batch's graph and the update's
    # every capture lent the held workspaces back and took them again: none per graph
    other = copy.deepcopy(model)
    one = nt.Step(other, torch.optim.SGD(other.parameters(), lr=0.1),
                  torch.nn.CrossEntropyLoss())
    for i in range(8):
        one(batches[i % 4])
    torch.cuda.synchronize()
    assert 1 <= graph.blas_workspaces == one._graph.graph.blas_workspaces
    step.close()
    one.close()


def test_a_failed_capture_gives_back_the_workspaces_it_was_lent():
    """A bucket's capture fails in its body (a host sync) after another bucket's graph was
    captured; the failing bucket is deferred and the captured one replays on. The workspaces
    lent to the failed capture are the step's again, so torch clearing its own frees none that
    a live graph uses (had one stayed in torch's map, the clearing would have handed it to the
    tensors allocated next, and the replays would write into them)."""
    run_script(textwrap.dedent("""
        import torch
        import torch.nn.functional as F
        import nimble_train as nt
        from bucket_reference import MaskedPool, lengths_batch, sample_losses
        from step_reference import assert_same_training, eager_loop, twin

        class SyncsAt8(MaskedPool):
            def forward(self, input_ids, attention_mask, labels=None):
                if input_ids.shape[1] == 8:  # a host sync at this length only
                    assert attention_mask.sum().item() >= 0
                return super().forward(input_ids, attention_mask)

        torch.manual_seed(0)
        sgd = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)
        (m1, o1), (m2, o2) = twin(SyncsAt8(dim=512).cuda(), sgd)
        g = torch.Generator().manual_seed(2)
        batches = [lengths_batch([30, 28, 25, 30] * 16, device="cuda", generator=g)
                   for _ in range(4)]  # every one in bucket 32
        # one stream: on several, a failed capture is retried on one, every bucket again
        step = nt.Step(m1, o1, sample_losses, buckets=nt.Buckets(sizes=(8, 32)), streams=1)
        # the capture stream's workspaces, from the allocator's common pool (what the clearing
        # would hand to other tensors)
        a = torch.randn(256, 256, device="cuda")
        with torch.cuda.stream(step._stream):
            torch.mm(a, a)
            F.linear(a, a, a[0])
        torch.cuda.synchronize()
        calls = step.stats()["warmup_left"] + 2
        for i in range(calls):
            step(batches[i % len(batches)])
        stats = step.stats()["shape_buckets"]
        assert stats[32]["captured"] and stats[8]["deferred"], stats
        assert step._graph.graph.blas_workspaces >= 1

        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        junk = [torch.full((4 << 20,), 7.0, device="cuda") for _ in range(32)]
        later = [batches[i % len(batches)] for i in range(calls, calls + 12)]
        for b in later:
            step(b)
        torch.cuda.synchronize()
        overwritten = sum(int((j != 7.0).sum()) for j in junk)
        assert overwritten == 0, f"the step's graph wrote {overwritten} elements of other tensors"
        assert step.stats()["shape_buckets"][32]["replays"] >= len(later)
        eager_loop(m2, o2, sample_losses, [batches[i % len(batches)] for i in range(calls)] + later)
        assert_same_training(m1, o1, m2, o2, rtol=2e-4, atol=2e-5)
        print("OK")
    """))
