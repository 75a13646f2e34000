"""Two Steps over one pair of networks, as a GAN trains: a critic's (discriminator's) step and
a generator's, each reading the other's parameters, alternating or several of the critic's per
generator's, the other network inside the step's model or read by its loss function. A step's
graphs must read the other network where the other step's update leaves it, whichever step
moved it into its flat buffers first; the loop must train as the eager one, and, once both are
captured, each call must stay on its step's fast path (no parameter moved back and forth)."""

import copy
import threading
import types

import pytest
import torch
import torch.nn.functional as F

import nimble_train as nt
from nimble_train.optim.fused import in_flat_buffers

pytestmark = pytest.mark.cuda

TOL = {"rtol": 2e-4, "atol": 2e-5}
NOISE, FEATURES, BATCH = 8, 12, 16
# The generator's forward raises inside a capture while set. An event, not a flag in a dict: a
# number the forward reads through a global config is watched, and its change after capture
# refused before anything runs (the graphs bake the branch it took).
FAIL_CAPTURE = threading.Event()


def generator():
    # No bias before the batch norm: its gradient is rounding noise, which Adam amplifies.
    return torch.nn.Sequential(torch.nn.Linear(NOISE, 32, bias=False), torch.nn.BatchNorm1d(32),
                               torch.nn.ReLU(), torch.nn.Linear(32, FEATURES))


def discriminator():
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.LeakyReLU(0.2),
                               torch.nn.Linear(32, 1))


class CriticStep(torch.nn.Module):
    """The critic's step: real samples and the generator's, the generator untouched."""

    def __init__(self, g, d):
        super().__init__()
        self.g, self.d = g, d

    def forward(self, real, z):
        with torch.no_grad():
            fake = self.g(z)
        return self.d(torch.cat([real, fake])).squeeze(1)


class GeneratorStep(torch.nn.Module):
    def __init__(self, g, d):
        super().__init__()
        self.g, self.d = g, d

    def forward(self, z):
        if FAIL_CAPTURE.is_set() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("injected failure inside the captured forward")
        return self.d(self.g(z)).squeeze(1)


def bce(logits, target):
    return F.binary_cross_entropy_with_logits(logits, target)


def data(n, seed):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [(torch.randn(BATCH, FEATURES, generator=gen).cuda(),
             torch.randn(BATCH, NOISE, generator=gen).cuda()) for _ in range(n)]


def adam(params):
    return torch.optim.Adam(params, lr=2e-3, betas=(0.5, 0.999))


def networks(seed):
    torch.manual_seed(seed)
    g, d = generator().cuda(), discriminator().cuda()
    return g, d, adam(g.parameters()), adam(d.parameters())


def twins(seed):
    g, d, opt_g, opt_d = networks(seed)
    g2, d2 = copy.deepcopy(g), copy.deepcopy(d)
    return (g, d, opt_g, opt_d), (g2, d2, adam(g2.parameters()), adam(d2.parameters()))


def targets():
    return (torch.cat([torch.ones(BATCH), torch.zeros(BATCH)]).cuda(),
            torch.ones(BATCH, device="cuda"))


def eager_gan(g, d, opt_g, opt_d, rounds):
    """rounds: ("critic" | "generator", (real, z)) in order; the plain loop of each."""
    target, ones = targets()
    for who, (real, z) in rounds:
        if who == "critic":
            opt_d.zero_grad()
            with torch.no_grad():
                fake = g(z)
            bce(d(torch.cat([real, fake])).squeeze(1), target).backward()
            opt_d.step()
        else:
            opt_g.zero_grad()
            bce(d(g(-z)).squeeze(1), ones).backward()
            opt_g.step()


class SteppedGan:
    def __init__(self, g, d, opt_g, opt_d, *, closure, critic_warmup=2, generator_warmup=2):
        self.g, self.d = g, d
        self.closure = closure
        if closure:
            # The critic's step is given the generator's samples; the generator's step reads
            # the critic through its loss function only: from its closure, or as an attribute
            # of a config of the user's networks it reads (closure="config").
            nets = types.SimpleNamespace(critic=d)
            gen_loss = ((lambda fake, y: bce(nets.critic(fake).squeeze(1), y))
                        if closure == "config" else lambda fake, y: bce(d(fake).squeeze(1), y))
            self.critic = nt.Step(d, opt_d, lambda out, y: bce(out.squeeze(1), y),
                                  warmup=critic_warmup)
            self.gen = nt.Step(g, opt_g, gen_loss, warmup=generator_warmup)
        else:
            self.critic = nt.Step(CriticStep(g, d), opt_d, bce, warmup=critic_warmup)
            self.gen = nt.Step(GeneratorStep(g, d), opt_g, bce, warmup=generator_warmup)

    def run(self, rounds):
        target, ones = targets()
        for who, (real, z) in rounds:
            if who == "generator":
                self.gen((-z, ones))
            elif self.closure:
                with torch.no_grad():
                    fake = self.g(z)
                self.critic((torch.cat([real, fake]), target))
            else:
                self.critic(((real, z), target))
        torch.cuda.synchronize()


def gan_rounds(batches, critic_steps, generator_first=False):
    rounds = []
    for i, batch in enumerate(batches):
        if generator_first and i % critic_steps == 0:
            rounds.append(("generator", batch))
        rounds.append(("critic", batch))
        if not generator_first and (i + 1) % critic_steps == 0:
            rounds.append(("generator", batch))
    return rounds


def assert_same(a, b, what):
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, **TOL, msg=lambda m, name=name: f"{what}.{name}: {m}")


def assert_same_gan(stepped, eager):
    (g, d, opt_g, opt_d), (g2, d2, opt_g2, opt_d2) = stepped, eager
    assert_same(g, g2, "generator")
    assert_same(d, d2, "critic")
    for a, b in ((opt_g, opt_g2), (opt_d, opt_d2)):
        for p, q in zip(a.param_groups[0]["params"], b.param_groups[0]["params"]):
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(a.state[p][key], b.state[q][key], **TOL)


def assert_on_fast_paths(gan, batches):
    """Two more rounds change no parameter's storage and capture nothing: each step's graphs
    read the other network where the other's update writes it."""
    where = [p.data_ptr() for p in (*gan.g.parameters(), *gan.d.parameters())]
    assert all(in_flat_buffers(p) for p in (*gan.g.parameters(), *gan.d.parameters()))
    captures = (gan.critic.stats()["captures"], gan.gen.stats()["captures"])
    calls = [gan.critic._call, gan.gen._call]
    slow = []
    gan.critic._call = lambda batch: slow.append("critic") or calls[0](batch)
    gan.gen._call = lambda batch: slow.append("generator") or calls[1](batch)
    try:
        gan.run(gan_rounds(batches, 1) * 2)
    finally:
        del gan.critic._call, gan.gen._call
    assert slow == []
    assert [p.data_ptr() for p in (*gan.g.parameters(), *gan.d.parameters())] == where
    assert (gan.critic.stats()["captures"], gan.gen.stats()["captures"]) == captures


@pytest.mark.parametrize("critic_steps", [1, 5], ids=["alternating", "five-critic-steps"])
@pytest.mark.parametrize("closure", [False, True], ids=["wrapped", "through-the-loss"])
def test_a_gan_trained_by_two_steps_equals_the_eager_loop(critic_steps, closure):
    stepped, eager = twins(0)
    rounds = gan_rounds(data(10 * critic_steps, seed=1), critic_steps)
    gan = SteppedGan(*stepped, closure=closure)
    gan.run(rounds)
    eager_gan(*eager, rounds)
    assert gan.critic.stats()["replays"] > 0 and gan.gen.stats()["replays"] > 0
    assert_same_gan(stepped, eager)
    assert_on_fast_paths(gan, data(1, seed=2))


@pytest.mark.parametrize("closure", [False, True, "config"],
                         ids=["wrapped", "through-the-loss", "through-a-config"])
def test_a_step_captured_before_the_other_fused_reads_the_others_update(closure):
    """The generator's step captures (reading the critic where it is) before the critic's
    step moves the critic into its flat buffers and updates it there: the generator's graphs
    must read the critic's new values, not the storage it left (a loss function's critic
    too, which the step knows only from the function's closure, or from a config of the
    user's networks the function reads it through)."""
    stepped, eager = twins(3)
    rounds = gan_rounds(data(10, seed=4), 1, generator_first=True)
    gan = SteppedGan(*stepped, closure=closure, critic_warmup=5, generator_warmup=2)
    gan.run(rounds[:6])  # the generator captured (its third call), the critic in warm-up
    assert gan.gen.stats()["replays"] == 1 and gan.critic.stats()["replays"] == 0
    assert not in_flat_buffers(gan.d[0].weight)
    gan.run(rounds[6:])
    assert in_flat_buffers(gan.d[0].weight) and gan.critic.stats()["replays"] > 0
    eager_gan(*eager, rounds)
    assert_same_gan(stepped, eager)
    assert_on_fast_paths(gan, data(1, seed=5))


def test_a_failed_capture_after_the_other_step_moved_its_network_loses_nothing():
    """The generator's graphs are captured again once the critic's step moved the critic; that
    capture failing raises, and leaves both networks and optimizers as after the last completed
    call; the generator's step then trains eagerly, as the loop does."""
    stepped, eager = twins(6)
    rounds = gan_rounds(data(8, seed=7), 1, generator_first=True)
    gan = SteppedGan(*stepped, closure=False, critic_warmup=5, generator_warmup=2)
    gan.run(rounds[:10])  # the critic fused on its fifth call, after the generator's capture
    assert in_flat_buffers(gan.d[0].weight) and gan.gen.stats()["replays"] == 3
    eager_gan(*eager, rounds[:10])
    FAIL_CAPTURE.set()
    try:
        with pytest.raises(nt.CaptureError, match="injected failure"):
            gan.run(rounds[10:11])
    finally:
        FAIL_CAPTURE.clear()
    assert_same_gan(stepped, eager)
    gan.run(rounds[10:])  # the failed call again, then on
    eager_gan(*eager, rounds[10:])
    assert gan.gen.stats()["replays"] == 3 and gan.gen.stats()["eager_steps"] == 5
    assert_same_gan(stepped, eager)
