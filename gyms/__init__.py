"""The gyms: one file per world, each keeping the contract in gym.py (sandbox.py is a tool, not a gym)."""
