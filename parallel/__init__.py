"""Several devices: torchrun workers, their process groups, and the parallel forms of the stages.

Stages compute on one device; what runs across ranks is applied from outside, through `Stage.parallelize`.
"""
