"""The capture tests' helpers live in :mod:`capturecases`, importable from every test file.

Each test starts from torch's global RNG seeded with 0 (``tests/conftest.py``), which the
model initialisations and ``torch.randn`` calls here draw from.
"""
