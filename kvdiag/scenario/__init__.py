"""Scenario stage: YAML scenarios validated into typed models."""

from kvdiag.scenario.loader import load_scenario, parse_scenario
from kvdiag.scenario.models import EngineSpec, Scenario, SimParams

__all__ = ["EngineSpec", "Scenario", "SimParams", "load_scenario", "parse_scenario"]
