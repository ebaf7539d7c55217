"""The simulator: conveyor's own scheduler and block manager on a hardware cost model.

See docs/simulation.md. Nothing in this package imports torch except `calibrate`'s measuring.
"""

from conveyor.sim.cost import CostModel, CostParams, RooflineCostModel, StepShape
from conveyor.sim.engine import SimEngine, SimRunner, build_sim_engine
from conveyor.sim.hardware import HARDWARE, Hardware, get_hardware
from conveyor.sim.models import MODEL_CONFIGS, ModelShape, get_model

__all__ = [
    "HARDWARE",
    "MODEL_CONFIGS",
    "CostModel",
    "CostParams",
    "Hardware",
    "ModelShape",
    "RooflineCostModel",
    "SimEngine",
    "SimRunner",
    "StepShape",
    "build_sim_engine",
    "get_hardware",
    "get_model",
]
