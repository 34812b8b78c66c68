"""The write side: what runs beside a trainer.

The capture lifecycle, its settings, the plain-loop passes, the end-of-training report pass.
"""
