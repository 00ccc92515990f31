"""Trainer config files read into diagnose's settings: the one YAML loader with its unknown-key notes (load), TRL's
GRPOConfig / AsyncGRPOConfig (trl) and verl's PPO trainer config (verl), each field checked against the framework
version it names. Part of integrations (its imports are the package's).
"""
