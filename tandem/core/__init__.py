"""The contracts every side of Tandem shares: the job schema (config), its checks on a machine (checks), the wire
types (protocol), the batch plan (plan), the reward total and shaping (shaping), the function loader (loader),
TRL's names (trl) and every process-wide tweak (compat). Imports nothing of Tandem's other packages and, at module
level, nothing heavier than pydantic, yaml and numpy."""
