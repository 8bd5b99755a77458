"""Speculation control: policies that choose an arm (drafter, k) per request class and load.

Engine-free and Ray-free: the live service and the simulator drive the same classes.
"""
from adaptspec.control.admission import SloAdmission
from adaptspec.control.baselines import (
    AdaptiveVerificationPolicy, BatchSchedulePolicy, EmaPolicy, HeuristicPolicy, PerClassStaticPolicy, ScheduleRange,
    StaticPolicy,
)
from adaptspec.control.base import Policy, PolicyConfig
from adaptspec.control.costmodel import OnlineStepCost, StepCostModel
from adaptspec.control.oracle import PlannerOracle
from adaptspec.control.thompson import ModelBasedThompson, ThompsonConfig
from adaptspec.control.types import (
    NO_SPEC,
    Arm,
    ClassTarget,
    DecisionStats,
    GroupOutcome,
    Load,
    RequestOutcome,
    StepOutcome,
)
from adaptspec.control.ucb import DiscountedUCB, UCBConfig

__all__ = [
    "Arm", "NO_SPEC", "Load", "RequestOutcome", "GroupOutcome", "StepOutcome", "ClassTarget",
    "DecisionStats", "Policy", "PolicyConfig", "ModelBasedThompson", "ThompsonConfig",
    "DiscountedUCB", "UCBConfig", "StaticPolicy", "BatchSchedulePolicy", "ScheduleRange",
    "EmaPolicy", "HeuristicPolicy", "PlannerOracle", "OnlineStepCost", "StepCostModel", "PerClassStaticPolicy",
    "AdaptiveVerificationPolicy", "SloAdmission",
]
