"""`num_processes` Learner actors forming one torch.distributed group; rank 0 speaks for them."""

from __future__ import annotations

import functools

from tandem.core.actor_names import actor_name, death_cause, node_line
from tandem.core.compat import learner_env_vars
from tandem.core.protocol import errors_as_text


def learner_actor_class(cfg, cls):
    """`cls` (the Learner) as a Ray actor asking for the job's learner resources, one per rank."""
    import ray

    r = cfg.cluster.learner_resources
    return ray.remote(num_cpus=r.num_cpus, num_gpus=r.num_gpus, resources=r.resources or None,
                      runtime_env={"env_vars": learner_env_vars(r.num_gpus > 0)})(cls)


# the learner's remote interface, declared once: what LearnerGroup calls on a rank, forwarded to the Learner by
# LearnerActor and by the colocated actor (services/orchestrator/colocated.py, each as learner_<name>)
LEARNER_METHODS = ("placement", "rendezvous", "setup", "train", "export_adapter", "save_checkpoint", "load_checkpoint",
                   "trainable_parameters")


def forward_learner_methods(cls, holder: str, prefix: str = "", around: str | None = None):
    """cls gains prefix + name for each of LEARNER_METHODS that it does not define itself, calling that method of
    the learner it holds in attribute `holder` (inside the context manager its method `around` returns, where
    given). -> cls."""
    def forward(name: str):
        def call(self, *args):
            if around is not None:
                with getattr(self, around)():
                    return getattr(getattr(self, holder), name)(*args)
            return getattr(getattr(self, holder), name)(*args)
        call.__name__ = call.__qualname__ = prefix + name
        return call
    for name in LEARNER_METHODS:
        if not hasattr(cls, prefix + name):
            setattr(cls, prefix + name, forward(name))
    return cls


@errors_as_text
@functools.partial(forward_learner_methods, holder="learner")
class LearnerActor:
    """The Ray actor of one rank: a Learner built in the actor's own process. Defined here, away from the
    Learner's module, so that the process starting the actors (the controller) never imports torch
    (~140 MB and seconds per job); its methods are LEARNER_METHODS, forwarded."""

    def __init__(self, *args):
        from tandem.learner.actor import Learner

        self.learner = Learner(*args)


class LearnerGroup:
    def __init__(self, cfg, total_steps: int, optimizer=None, probe: str | None = None, wait: bool = True,
                 actor_class=None, prefix: str = ""):
        """Starts the actors; waits for every rank's setup (the process group forms there) unless
        wait=False: then `ready()` does (the rollout workers start meanwhile). actor_class: a Ray actor
        class built from the Learner's arguments whose LEARNER_METHODS are named prefix + method (the
        colocated rollout worker, cluster.vllm_mode colocate); None: LearnerActor."""
        n = cfg.cluster.num_processes
        cls = actor_class or learner_actor_class(cfg, LearnerActor)
        self._prefix = prefix
        self.actors = [cls.options(name=actor_name("learner", rank, cfg.logging.output_dir)).remote(
            cfg, rank, n, total_steps, optimizer, probe) for rank in range(n)]
        self._placed = [self._method(a, "placement").remote() for a in self.actors]
        # rank 0 opens the group's store on its own node; Ray hands each setup the address once it exists
        address = self._method(self.actors[0], "rendezvous").remote()
        self._setup = [self._method(a, "setup").remote(address) for a in self.actors]
        self._cfg, self.placements = cfg, None  # placements: each rank's node, once ready
        if wait:
            self.ready()

    def _method(self, actor, name: str):
        return getattr(actor, self._prefix + name)

    def ready(self) -> None:
        import ray

        from tandem.core.checks import raise_if, shared_gpu_error

        self.placements = ray.get(self._placed)
        raise_if([shared_gpu_error(self._cfg, self.placements)])  # before NCCL fails on it, obscurely
        ray.get(self._setup)

    def lost(self, error, patience_s: float = 10.0) -> str | None:
        """The line that names a lost rank where `error` (a RayActorError, or an object its owner took with it) is
        this group's: the rank whose actor it names, or else the first rank that does not answer within patience_s.
        -> `learner rank R on node HOST (IP, Ray node ID) lost (CAUSE)`, or None (every rank answers)."""
        import ray

        ids = [a._actor_id.hex() for a in self.actors]
        rank = ids.index(error.actor_id) if getattr(error, "actor_id", None) in ids else None
        for r, a in enumerate(self.actors if rank is None else ()):
            try:
                ray.get(a.__ray_ready__.remote(), timeout=patience_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                rank, error = r, e
                break
        if rank is None:
            return None
        p = self.placements[rank] if self.placements else {}
        where = node_line(p.get("host", "?"), p.get("ip", "?"), str(p.get("node", "?")))
        return f"learner rank {rank} on node {where} lost ({death_cause(error)})"

    def _all(self, method: str, *args):
        import ray

        return ray.get([self._method(a, method).remote(*args) for a in self.actors])

    def train_async(self, groups_or_refs, export: bool = False) -> list:
        """Every rank's training; export: rank 0's result carries the new adapter (Learner.train)."""
        return [self._method(a, "train").remote(groups_or_refs, export) for a in self.actors]

    def train(self, groups_or_refs) -> dict:
        """Every rank gets the same list (object refs resolve in each rank's object store)."""
        return self._all("train", groups_or_refs)[0]

    def export_adapter(self):
        import ray

        return ray.get(self._method(self.actors[0], "export_adapter").remote())

    def save_checkpoint(self, directory: str, extra: dict | None = None) -> str:
        return self._all("save_checkpoint", directory, extra)[0]

    def load_checkpoint(self, directory: str) -> dict:
        return self._all("load_checkpoint", directory)[0]

    def trainable_parameters(self) -> dict:
        import ray

        return ray.get(self._method(self.actors[0], "trainable_parameters").remote())

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
