"""Built-in tasks that need no download: their data ships inside scikit-learn."""

from fedtrain.examples.breast_cancer import BreastCancerTask
from fedtrain.examples.digits import DigitsTask

__all__ = ["BreastCancerTask", "DigitsTask"]
