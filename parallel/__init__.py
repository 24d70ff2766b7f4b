"""Several devices: torchrun workers, their process groups, and the parallel forms of the stages.

Stages compute on one device; what runs across ranks is applied from outside, through `Stage.parallelize`.

launch (the command's side: checks, torchrun's agent, a failure's root cause), worker and serve (a worker's life:
the plan from rank 0, its group, its share of the clips), layout (groups x Ulysses degree), group_render (one
rank of a group), events (the other groups' clips reported by rank 0).
"""
