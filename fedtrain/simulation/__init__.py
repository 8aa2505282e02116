"""Virtual clients on one machine, running the same Task and Strategy code as a deployment."""

from fedtrain.simulation.config import SimConfig
from fedtrain.simulation.engine import run_simulation
from fedtrain.simulation.run import SimulationResult

__all__ = ["SimConfig", "SimulationResult", "run_simulation"]
