"""The batch plan (docs/grpo.md §3): one implementation, used by `tandem plan` and by the learner.

A generation batch holds `unique_prompts` groups of `num_generations` contiguous samples.
Micro-step k of a cycle takes samples [k·P·B, (k+1)·P·B), split contiguously by process;
`num_iterations` replays the same micro-steps; an optimizer step closes every
`gradient_accumulation_steps` micro-steps.
"""

from __future__ import annotations

from dataclasses import dataclass


def batch_error(per: int, ga: int, spg: int, G: int, nproc: int, mu: int) -> str | None:
    """docs/grpo.md §3's two rules, or None: the generation batch holds whole groups, and every cycle
    holds whole optimizer steps. The message names the fields and proposes values that work."""
    ebs = spg * nproc * per
    if ebs % G:
        near_b = sorted((x for x in range(1, 4 * per + G + 1) if (spg * nproc * x) % G == 0),
                        key=lambda x: (abs(x - per), x))[:2]
        near_s = sorted((s for s in range(1, 4 * spg + G + 1) if (s * nproc * per) % G == 0 and (s * mu) % ga == 0),
                        key=lambda s: (abs(s - spg), s))[:1]
        return (f"effective_batch_size = steps_per_generation × num_processes × per_device_train_batch_size = "
                f"{spg} × {nproc} × {per} = {ebs} is not divisible by batch.num_generations = {G}; try "
                f"batch.per_device_train_batch_size in {near_b} or batch.steps_per_generation in {near_s}")
    if (spg * mu) % ga:
        return (f"batch.steps_per_generation × grpo.num_iterations = {spg} × {mu} is not a multiple of "
                f"batch.gradient_accumulation_steps = {ga}: every generation cycle must hold whole optimizer steps")
    return None


@dataclass(frozen=True)
class MicroStep:
    index: int  # micro-step within the cycle, 0 .. steps_per_generation·num_iterations − 1
    iteration: int  # PPO epoch over the generation batch (0-based)
    rows: tuple[range, ...]  # per process: sample indices into the generation batch
    optimizer_step: bool  # an optimizer step follows this micro-step


@dataclass(frozen=True)
class BatchPlan:
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    steps_per_generation: int
    num_generations: int
    num_processes: int = 1
    num_iterations: int = 1

    def __post_init__(self) -> None:
        err = batch_error(self.per_device_train_batch_size, self.gradient_accumulation_steps,
                          self.steps_per_generation, self.num_generations, self.num_processes, self.num_iterations)
        if err:
            raise ValueError(err)

    @classmethod
    def from_config(cls, cfg) -> BatchPlan:
        """From a validated job (its batch section resolved: steps_per_generation filled in)."""
        b = cfg.batch
        return cls(
            per_device_train_batch_size=b.per_device_train_batch_size,
            gradient_accumulation_steps=b.gradient_accumulation_steps,
            steps_per_generation=b.steps_per_generation,
            num_generations=b.num_generations,
            num_processes=cfg.cluster.num_processes,
            num_iterations=cfg.grpo.num_iterations,
        )

    @property
    def effective_batch_size(self) -> int:
        return self.steps_per_generation * self.num_processes * self.per_device_train_batch_size

    @property
    def unique_prompts(self) -> int:
        return self.effective_batch_size // self.num_generations

    @property
    def optimizer_steps_per_generation(self) -> float:
        """Spec's formula (per PPO epoch); with num_iterations = μ a cycle holds μ times as many."""
        return self.steps_per_generation / self.gradient_accumulation_steps

    @property
    def optimizer_steps_per_cycle(self) -> int:
        return self.steps_per_generation * self.num_iterations // self.gradient_accumulation_steps

    def total_cycles(self, max_steps: int, num_train_epochs: float, rows: int) -> int:
        """Generation cycles of a run: enough for max_steps optimizer steps (when > 0), else num_train_epochs passes
        over `rows` prompts (at least one cycle)."""
        if max_steps > 0:
            return -(-max_steps // self.optimizer_steps_per_cycle)
        return max(int(num_train_epochs * rows) // self.unique_prompts, 1)

    def rows(self, step: int, rank: int) -> range:
        k = step % self.steps_per_generation
        start = (k * self.num_processes + rank) * self.per_device_train_batch_size
        return range(start, start + self.per_device_train_batch_size)

    def cycle(self) -> list[MicroStep]:
        n = self.steps_per_generation * self.num_iterations
        return [
            MicroStep(
                index=j,
                iteration=j // self.steps_per_generation,
                rows=tuple(self.rows(j, p) for p in range(self.num_processes)),
                optimizer_step=(j + 1) % self.gradient_accumulation_steps == 0,
            )
            for j in range(n)
        ]

    def optimizer_steps(self) -> list[list[MicroStep]]:
        """The cycle's micro-steps grouped by the optimizer step they feed."""
        groups: list[list[MicroStep]] = [[]]
        for m in self.cycle():
            groups[-1].append(m)
            if m.optimizer_step:
                groups.append([])
        return groups[:-1]

    def sample(self, index: int) -> tuple[int, int]:
        """(prompt within the cycle, generation within the group) of a generation-batch row."""
        return divmod(index, self.num_generations)


def arithmetic(plan: BatchPlan) -> list[str]:
    return [
        f"effective_batch_size = steps_per_generation × num_processes × per_device_train_batch_size "
        f"= {plan.steps_per_generation} × {plan.num_processes} × {plan.per_device_train_batch_size} "
        f"= {plan.effective_batch_size}",
        f"optimizer_steps_per_generation = steps_per_generation / gradient_accumulation_steps "
        f"= {plan.steps_per_generation} / {plan.gradient_accumulation_steps} "
        f"= {plan.optimizer_steps_per_generation:g}",
        f"unique_prompts = effective_batch_size / num_generations = {plan.effective_batch_size} / "
        f"{plan.num_generations} = {plan.unique_prompts}",
        f"num_iterations = {plan.num_iterations}: {len(plan.cycle())} micro-steps and "
        f"{plan.optimizer_steps_per_cycle} optimizer step(s) per generation cycle",
    ]


def table(plan: BatchPlan, cycles: int = 2) -> str:
    """The seed-style table: step | batch (prompt of each row, numbered across cycles) | note."""
    out: list[str] = []
    ranks = plan.num_processes
    head = "| step | batch | note |" if ranks == 1 else (
        "| step | " + " | ".join(f"rank {p}" for p in range(ranks)) + " | note |"
    )
    sep = "| -: | " + " | ".join(["---"] * ranks) + " | --- |"
    for c in range(cycles):
        out += [f"generation cycle {chr(ord('A') + c)}", "", head, sep]
        offset = c * plan.unique_prompts
        for m in plan.cycle():
            cells = ["[" + ",".join(str(offset + plan.sample(i)[0]) for i in r) + "]" for r in m.rows]
            note = []
            if m.optimizer_step:
                note.append(f"optimizer step (accum = {plan.gradient_accumulation_steps} reached)")
            if plan.num_iterations > 1 and m.index % plan.steps_per_generation == 0:
                note.append(f"iteration {m.iteration + 1} of {plan.num_iterations}")
            out.append(f"| {m.index} | " + " | ".join(cells) + f" | {'; '.join(note)} |")
        out.append("")
    return "\n".join(out)
