"""airbench94's network: its shapes and parameter count, airbench's BatchNorm settings and conv
initialisation, float32 against float64, and the whitening initialisation of its stem."""

import copy

import pytest
import torch
import torch.nn.functional as F

import nimble_train as nt
from nimble_train.models.airbench import init_whitening


def expected_parameters(widths, num_classes, whiten=24):
    """airbench's layers, counted from their shapes: the 2×2 stem with a bias; per group two
    bias-free 3×3 convs and two BatchNorms (a scale and a shift per channel); the bias-free
    linear head."""
    count = 3 * whiten * 2 * 2 + whiten
    channels = (whiten, *widths)
    for a, b in zip(channels, channels[1:]):
        count += a * b * 9 + b * b * 9 + 2 * (2 * b)
    return count + widths[-1] * num_classes


@pytest.mark.parametrize("widths, num_classes", [((64, 256, 256), 10), ((16, 32, 48), 7)])
def test_output_shape_and_parameter_count(widths, num_classes):
    torch.manual_seed(0)
    model = nt.models.airbench_cifar(num_classes=num_classes, widths=widths)
    assert sum(p.numel() for p in model.parameters()) == expected_parameters(widths, num_classes)
    if widths == (64, 256, 256):
        assert expected_parameters(widths, num_classes) == 1_972_792
    for batch, size in [(3, 32), (1, 32), (2, 9), (2, 40)]:
        out = model(torch.randn(batch, 3, size, size))
        assert out.shape == (batch, num_classes) and torch.isfinite(out).all()


def test_batchnorm_settings_scale_and_identity_start():
    model = nt.models.airbench_cifar()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(norms) == 6
    # airbench's momentum 0.6 weighs the old running value: torch's 0.4 weighs the new one.
    assert all(m.momentum == 0.4 and m.eps == 1e-12 for m in norms)
    assert model.scale == pytest.approx(1 / 9)
    convs = [m for m in model.groups.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 6 and all(c.bias is None and c.kernel_size == (3, 3) for c in convs)
    for conv in convs:  # the first in_channels filters pass their input channel through
        n = conv.in_channels
        identity = torch.zeros(n, n, 3, 3)
        identity[torch.arange(n), torch.arange(n), 1, 1] = 1
        assert torch.equal(conv.weight[:n].detach(), identity)
    x = torch.randn(4, 3, 32, 32)
    logits = model(x)
    unscaled = model.head(F.adaptive_max_pool2d(model.groups(model.activ(model.whiten(x))), 1)
                          .flatten(1))
    torch.testing.assert_close(logits, unscaled / 9)



def test_the_global_max_trains_as_airbench_max_pool():
    # At 32x32 inputs the last map is 3x3: the max over it is airbench's MaxPool2d(3), in the
    # loss and in every gradient (random data has no tied maxima), channels-last as on a GPU.
    torch.manual_seed(3)
    model = nt.models.airbench_cifar().to(memory_format=torch.channels_last)
    reference = copy.deepcopy(model)

    def max_pooled(x):
        m = reference
        return m.head(F.max_pool2d(m.groups(m.activ(m.whiten(x))), 3).flatten(1)) * m.scale
    x = torch.randn(6, 3, 32, 32).to(memory_format=torch.channels_last)
    target = torch.randint(0, 10, (6,))
    loss = F.cross_entropy(model(x), target)
    expected = F.cross_entropy(max_pooled(x), target)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert model.head.weight.grad.abs().sum() > 0

def test_float32_forward_and_backward_match_float64():
    # eps 1e-12 is kept from airbench: it only matters for a channel of near-zero batch
    # variance, and float32 represents it exactly enough. The float32 error is judged against
    # float64 and bounded relative to the output's size.
    torch.manual_seed(1)
    model = nt.models.airbench_cifar()
    x = torch.randn(8, 3, 32, 32)
    target = torch.randint(0, 10, (8,))
    model64 = nt.models.airbench_cifar().double()
    model64.load_state_dict({k: v.double() if v.is_floating_point() else v
                             for k, v in model.state_dict().items()})
    out32, out64 = model(x), model64(x.double())
    assert (out32.double() - out64).abs().max() <= 1e-4 * out64.abs().max()
    F.cross_entropy(out32, target).backward()
    F.cross_entropy(out64, target).backward()
    for (name, p32), p64 in zip(model.named_parameters(), model64.parameters()):
        err = (p32.grad.double() - p64.grad).abs().max()
        assert err <= 1e-3 * p64.grad.abs().max() + 1e-12, name


def correlated_images(n, size, *, generator):
    """Random float64 images whose 2×2 patches are far from white: channels mixed, pixels
    smoothed, a per-channel offset and one nearly flat direction."""
    x = torch.randn(n, 3, size + 2, size + 2, dtype=torch.float64, generator=generator)
    x = F.avg_pool2d(x, 3, stride=1)  # neighbouring pixels correlated
    mix = torch.tensor([[1.0, 0.8, 0.6], [0.0, 0.5, 0.4], [0.0, 0.0, 0.05]], dtype=torch.float64)
    return torch.einsum("ij,njhw->nihw", mix, x) + torch.tensor([0.3, -0.2, 0.1],
                                                                dtype=torch.float64).view(3, 1, 1)


@pytest.mark.parametrize("eps", [0.0, 5e-4])
def test_init_whitening_whitens_the_patches(eps):
    g = torch.Generator().manual_seed(2)
    images = correlated_images(64, 16, generator=g)
    conv = torch.nn.Conv2d(3, 24, 2, padding=0, bias=True).double()
    bias = conv.bias.detach().clone()
    init_whitening(conv, images, eps=eps)
    assert torch.equal(conv.bias.detach(), bias)  # only the weights are set

    # The stem's outputs without its bias, one row per 2×2 patch: [patches, 24].
    out = F.conv2d(images, conv.weight).permute(0, 2, 3, 1).reshape(-1, 24)
    moment = out.T @ out / out.shape[0]   # second moment, as airbench's (uncentred) covariance
    patches = F.unfold(images, 2).transpose(1, 2).reshape(-1, 12)
    eigenvalues = torch.linalg.eigvalsh(patches.T @ patches / patches.shape[0]).flip(0)
    expected = torch.diag(eigenvalues / (eigenvalues + eps))
    # Filters 12..23 are the negatives of 0..11: the full moment is [[D, -D], [-D, D]].
    torch.testing.assert_close(moment, torch.cat([torch.cat([expected, -expected], 1),
                                                  torch.cat([-expected, expected], 1)]),
                               rtol=0, atol=1e-9)
    if eps == 0:
        torch.testing.assert_close(moment[:12, :12], torch.eye(12, dtype=torch.float64),
                                   rtol=0, atol=1e-9)
    else:  # directions of variance far above eps come out white, those far below it damped
        diagonal = moment.diagonal()[:12]
        high, low = eigenvalues > 100 * eps, eigenvalues < eps / 5
        assert high.any() and low.any()
        assert (diagonal[high] > 0.99).all() and (diagonal[low] < 0.2).all()
    assert (eigenvalues[:-1] >= eigenvalues[1:]).all()  # filter 0 along the largest variance


def test_init_whitening_keeps_requires_grad_and_dtype():
    images = torch.randn(4, 3, 12, 12)
    for wanted in (True, False):
        conv = torch.nn.Conv2d(3, 24, 2)
        conv.weight.requires_grad_(wanted)
        init_whitening(conv, images)
        assert conv.weight.requires_grad is wanted and conv.weight.dtype == torch.float32
        assert torch.isfinite(conv.weight).all()
    model = nt.models.airbench_cifar()
    init_whitening(model.whiten, images)
    assert model(images).shape == (4, 10)


def test_init_whitening_refuses_a_conv_of_the_wrong_shape():
    with pytest.raises(ValueError, match="needs 2 x in_channels x kernel area = 24 output "
                                         "channels and groups=1; got 12"):
        init_whitening(torch.nn.Conv2d(3, 12, 2), torch.randn(2, 3, 8, 8))
    with pytest.raises(ValueError, match=r"images must be \[N, 3, H, W\]; got \[2, 1, 8, 8\]"):
        init_whitening(torch.nn.Conv2d(3, 24, 2), torch.randn(2, 1, 8, 8))
