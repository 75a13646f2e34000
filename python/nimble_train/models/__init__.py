"""Reference models for the recipes, benchmarks and tests."""

from .branchy import branchy_cifar
from .resnet_cifar import resnet18_cifar

__all__ = ["branchy_cifar", "resnet18_cifar"]
