"""Reference models for the recipes, benchmarks and tests."""

from .resnet_cifar import resnet18_cifar

__all__ = ["resnet18_cifar"]
