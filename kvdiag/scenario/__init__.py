"""Scenario stage: YAML scenarios validated into typed models."""
