"""Reference models for the recipes, benchmarks and tests."""

from .airbench import airbench_cifar, init_whitening
from .branchy import branchy_cifar
from .resnet_cifar import resnet18_cifar

__all__ = ["airbench_cifar", "branchy_cifar", "init_whitening", "resnet18_cifar"]
