"""mylab: a research group's own federated algorithms, outside fedtrain.

An example of the package a user writes: fedtrain loads `mylab.strategies:...` by
import reference from `[strategy] name`, like a task. Put its folder on PYTHONPATH
(or pip-install it) wherever the server or the simulation runs.
"""
