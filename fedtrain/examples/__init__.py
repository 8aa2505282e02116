"""Built-in tasks that need no download: scikit-learn's bundled sets, or generated data."""

from fedtrain.examples.breast_cancer import BreastCancerTask
from fedtrain.examples.digits import DigitsTask
from fedtrain.examples.synthetic import FrozenBaseTask, SyntheticTask

__all__ = ["BreastCancerTask", "DigitsTask", "FrozenBaseTask", "SyntheticTask"]
