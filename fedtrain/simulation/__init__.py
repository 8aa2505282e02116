"""Virtual clients on one machine, running the same Task and Strategy code as a deployment."""

from fedtrain.simulation.config import SimConfig
from fedtrain.simulation.engine import SimulationResult, run_simulation

__all__ = ["SimConfig", "SimulationResult", "run_simulation"]
