"""What every gate needs: the endpoint, the three model names, and one shared cache of
greedy responses so that gates reading the same prompt never sample it twice."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from safety.config import SamplingConfig
from safety.gates.client import Completion, VllmClient
from safety.gates.probes import Probe


@dataclass
class SuiteContext:
    client: VllmClient
    sampling: SamplingConfig
    candidate: str
    incumbent: str
    base: str
    _responses: dict[tuple[str, str], asyncio.Task[Completion]] = field(default_factory=dict)

    def noise(self, probes: int) -> float:
        """The rate change that `noise_probes` flipped probes out of `probes` amount to."""
        return self.sampling.noise_probes / probes if probes else 0.0

    def respond(self, model: str, probe: Probe) -> asyncio.Task[Completion]:
        """The (memoised) greedy, seeded response of `model` to `probe`."""
        key = (model, probe.prompt + f"\x00{probe.max_tokens}")
        task = self._responses.get(key)
        if task is None:
            task = asyncio.ensure_future(
                self.client.chat(
                    model,
                    probe.messages(),
                    max_tokens=probe.max_tokens or self.sampling.max_tokens,
                    temperature=self.sampling.temperature,
                    seed=self.sampling.seed,
                )
            )
            self._responses[key] = task
        return task

    def references(self, against_base: bool) -> list[tuple[str, str]]:
        """(role, served name) of what a gate bounds the candidate by: the incumbent, and the
        base model when `against_base` and it is another name (before the first promotion
        the incumbent is the base)."""
        roles = [("incumbent", self.incumbent)]
        if against_base and self.base != self.incumbent:
            roles.append(("base", self.base))
        return roles

    async def respond_references(
        self, probes: list[Probe], against_base: bool
    ) -> tuple[list[Completion], dict[str, list[Completion]]]:
        """The candidate's responses, and each reference's by role, all in flight at once."""
        roles = self.references(against_base)
        models = [self.candidate, *(name for _, name in roles)]
        # Plain gather, not `gather_or_cancel`: these tasks are shared, another gate may still
        # await one this gate gives up on, and `close` cancels what is left at the end.
        done = await asyncio.gather(*[self.respond(m, p) for m in models for p in probes])
        parts = [list(done[k * len(probes) : (k + 1) * len(probes)]) for k in range(len(models))]
        return parts[0], {role: part for (role, _), part in zip(roles, parts[1:], strict=True)}

    async def close(self) -> None:
        """Cancel what no gate awaits any more; collect failures another gate already reported."""
        for task in self._responses.values():
            if not task.done():
                task.cancel()
        await asyncio.gather(*self._responses.values(), return_exceptions=True)
