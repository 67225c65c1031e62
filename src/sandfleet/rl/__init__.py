"""What an RL trainer needs from sandfleet beyond single sandboxes.

:class:`RolloutPool` runs a batch of episodes, one sandbox each, with bounded
concurrency, retried creation, progress, and preemption: when the trainer is
told it is going away the pool pauses its sandboxes; a new driver of the same
job re-attaches to them and fast-forwards every episode through its sandbox's
trajectory log, so no command runs twice and every reward comes out the same.
"""

from sandfleet.rl.pool import EpisodeFn, Preempted, RolloutPool, RolloutStats

__all__ = ["EpisodeFn", "Preempted", "RolloutPool", "RolloutStats"]
