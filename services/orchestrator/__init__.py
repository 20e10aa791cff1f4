"""One job's orchestration inside the Controller actor: the controller and its parts (prompt source, rollout pool,
group buffer, failure log, trained record, checkpointer, run log, evaluator, trackers) and the colocated actor.
Imports nothing of the app (services/app)."""
