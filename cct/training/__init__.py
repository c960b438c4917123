"""Training on top of the runtime: the solver loop (solver), the six update
rules (updates, imported here so that get_solver finds every type), snapshots
(snapshot) and learning-rate policies (lr_policy)."""
from cct.training import updates  # noqa: F401  (registers the solver types)
