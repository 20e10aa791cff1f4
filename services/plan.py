"""The batch plan (spec §3): one implementation, used by `tandem plan` and by the learner.

A generation batch holds `unique_prompts` groups of `num_generations` contiguous samples.
Micro-step k of a cycle takes samples [k·P·B, (k+1)·P·B), split contiguously by process;
`num_iterations` replays the same micro-steps; an optimizer step closes every
`gradient_accumulation_steps` micro-steps.
"""

from __future__ import annotations

from dataclasses import dataclass


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
        if self.effective_batch_size % self.num_generations:
            raise ValueError(
                f"effective_batch_size {self.effective_batch_size} not divisible by num_generations "
                f"{self.num_generations}"
            )
        if (self.steps_per_generation * self.num_iterations) % self.gradient_accumulation_steps:
            raise ValueError("steps_per_generation × num_iterations must be a multiple of gradient_accumulation_steps")

    @classmethod
    def from_config(cls, cfg) -> BatchPlan:
        return cls.from_sections(cfg.batch, cfg.cluster.num_processes, cfg.grpo.num_iterations)

    @classmethod
    def from_sections(cls, b, num_processes: int, num_iterations: int) -> BatchPlan:
        """From a resolved `batch` section (steps_per_generation filled in)."""
        return cls(
            per_device_train_batch_size=b.per_device_train_batch_size,
            gradient_accumulation_steps=b.gradient_accumulation_steps,
            steps_per_generation=b.steps_per_generation,
            num_generations=b.num_generations,
            num_processes=num_processes,
            num_iterations=num_iterations,
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
