"""Training on top of the runtime: the solver loop, update rules, snapshots
and learning-rate policies."""
