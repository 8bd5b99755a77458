"""The simulator's step-cost models: ``adaptspec.control.costs`` (the service seeds its
controller from the same profiles, and the service must not import the simulator)."""
from adaptspec.control.costs import *  # noqa: F401,F403
from adaptspec.control.costs import ProfileCostModel, ProfileFile, StepTime  # noqa: F401
