"""The user's model run outside its training steps.

Sample ids, labels and losses, RNG and weight guards, the samples a pass covers, recompute.
"""
