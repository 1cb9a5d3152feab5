"""nanochat's import path for Muon until 2026-01-29 (`from nanochat.muon import Muon, DistMuon`); the code is
nanochat/optim/muon.py."""

from nanochat.optim.muon import DistMuon, Muon

__all__ = ["DistMuon", "Muon"]
