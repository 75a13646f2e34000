"""Captured steps whose memset nodes become kernel nodes (src/capture/graph_nodes.h): the graph
computes what it did with memsets, a Step trains as the eager loop and bit for bit as with the
memsets left in, and a capture failing after the rewrite leaves the model and optimizer as
after the last completed step. The kernel's bytes and the rewrite's edges are tested in
tests/cpp/test_graph_nodes_cuda.cpp."""

import pytest
import torch
import torch.nn.functional as F

import nimble_train as nt
from nimble_train import _capture
from nimble_train._extension import _C
from nimble_train.bench import modes
from nimble_train.bench.workloads import make_workload
from step_reference import SmallCNN, assert_same_training, classification_batches, eager_loop, twin

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("deterministic_cudnn")]

# Against the eager loop: fused SGD and cuDNN's channels-last kernels round differently (the
# memsets' rewrite itself changes no bit: compared with the memsets left in, bit for bit).
TOL = {"rtol": 1e-3, "atol": 1e-4}


def per_sample(logits, y):
    return F.cross_entropy(logits, y, reduction="none")


class Zeroed(torch.nn.Module):
    """Adds a buffer it first zeroes with cudaMemsetAsync (as cuDNN zeroes its workspaces): a
    memset node in every capture, which the additions after it read."""

    def __init__(self, channels):
        super().__init__()
        self.register_buffer("scratch", torch.full((1, channels, 1, 1), 7.0))

    def forward(self, x):
        _C.cuda_memset(self.scratch, 0)
        return x + self.scratch


class CNNWithMemset(SmallCNN):
    def __init__(self):
        super().__init__()
        self.zeroed = Zeroed(8)

    def forward(self, x):
        x = self.zeroed(F.relu(self.bn1(self.conv1(x))))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


def test_a_step_graphs_memsets_become_kernels_that_write_the_same_bytes():
    graph = _C.StepGraph(torch.device("cuda", 0), 0)
    x = torch.zeros(4, device="cuda")  # the batch the launches copy in: unused
    outputs = {}
    buffers = {}
    for rewrite in (True, False):
        entry = graph.add_entry([("batch[0]", x, x.stride(), True)])
        buffers[rewrite] = buf = torch.full((1000,), 3.0, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph.begin_capture(entry, staged=False, memsets_as_kernels=rewrite)
            buf.add_(1.0)
            _C.cuda_memset(buf[:333], 0)  # after the addition, before the next one
            buf.add_(2.0)
            _C.cuda_memset(buf[500:501], 0xFF)  # a NaN of float32's bytes
            outputs[rewrite] = buf * 1.0
            assert graph.end_capture().ok
        torch.cuda.current_stream().wait_stream(side)
        assert graph.memset_nodes(entry) == (2 if rewrite else 0)
        for _ in range(3):
            graph.launch(entry, [x], [])
    torch.cuda.synchronize()
    expected = torch.full((1000,), 3.0 + 3 * (1 + 2), device="cuda")  # after 3 launches
    expected[:333] = 2.0
    expected[500] = float("nan")
    for rewrite in (True, False):
        torch.testing.assert_close(outputs[rewrite], expected, equal_nan=True)
        assert torch.equal(buffers[rewrite].view(torch.int32)[500], torch.tensor(-1, device="cuda"))
    graph.release()


@pytest.mark.parametrize("streams", [1, "auto"])
def test_a_step_with_memsets_as_kernels_trains_as_eager_and_as_with_memsets(streams,
                                                                           monkeypatch):
    batches = classification_batches(6, 16, device="cuda", image=True)
    trained = {}
    for rewrite in (True, False):
        monkeypatch.setattr(_capture, "MEMSETS_AS_KERNELS", rewrite)
        torch.manual_seed(0)
        model, opt = twin(CNNWithMemset().cuda().to(memory_format=torch.channels_last),
                          lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))[0]
        step = nt.Step(model, opt, per_sample, streams=streams, warmup=2)
        for b in batches:
            step(b)
        stats = step.stats()
        assert stats["captured"]
        assert (stats["memset_nodes_as_kernels"] >= 1) == rewrite
        trained[rewrite] = (model, opt)
    for a, b in zip(trained[True][0].state_dict().values(),
                    trained[False][0].state_dict().values()):
        assert torch.equal(a, b)
    torch.manual_seed(0)
    ref, ref_opt = twin(CNNWithMemset().cuda().to(memory_format=torch.channels_last),
                        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))[0]
    eager_loop(ref, ref_opt, per_sample, batches)
    assert_same_training(*trained[True], ref, ref_opt, **TOL)


def test_a_capture_failing_after_the_rewrite_keeps_state_and_goes_on_eagerly():
    torch.manual_seed(1)
    (m1, o1), (m2, o2) = twin(CNNWithMemset().cuda(),
                              lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    batches = classification_batches(5, 16, device="cuda", image=True)
    # one stream: with "auto" a failed capture on several streams is retried on one
    step = nt.Step(m1, o1, per_sample, streams=1, warmup=2)
    step(batches[0])
    step(batches[1])  # warm-up done: the next call captures
    step._graph.graph.fail_next_capture_end()
    with pytest.raises(nt.CaptureError, match="injected failure after the memset rewrite"):
        step(batches[2])
    eager_loop(m2, o2, per_sample, batches[:2])
    assert_same_training(m1, o1, m2, o2, **TOL)
    step(batches[3])  # later calls run eagerly, as the eager loop
    step(batches[4])
    eager_loop(m2, o2, per_sample, batches[3:])
    assert_same_training(m1, o1, m2, o2, **TOL)


def test_the_hand_written_anchor_rewritten_trains_as_the_plain_one():
    """The bench's graph-fused-kernels anchor: torch's whole-step graph with its memset nodes
    rewritten, bit for bit the plain graph-fused one; both built before either runs (each step
    function keeps its model and optimizer alive)."""
    w = make_workload("resnet18", 8, "cuda")
    plain = modes.hand_graph(w, fused=True)
    rewritten = modes.hand_graph(w, fused=True, memsets_as_kernels=True)
    for i in range(4):
        for step in (plain, rewritten):
            step(w.batches[i % len(w.batches)])
    torch.cuda.synchronize()
    for a, b in zip(plain.model.state_dict().values(), rewritten.model.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(plain.optimizer.state.values(), rewritten.optimizer.state.values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
