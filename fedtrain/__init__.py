"""fedtrain: federated learning for PyTorch.

The core (`tensors`, `task`, `strategy`, `secagg`) knows nothing about networks or
processes; `runtime` (gRPC server and site daemons) and `simulation` (virtual clients)
are drivers on top of it.
"""

__version__ = "0.1.0"
