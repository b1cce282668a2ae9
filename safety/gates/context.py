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

    async def respond_both(self, probes: list[Probe]) -> tuple[list[Completion], list[Completion]]:
        """Candidate and incumbent responses to every probe, all requests in flight at once."""
        tasks = [self.respond(self.candidate, p) for p in probes]
        tasks += [self.respond(self.incumbent, p) for p in probes]
        done = await asyncio.gather(*tasks)
        return list(done[: len(probes)]), list(done[len(probes) :])

    async def close(self) -> None:
        """Cancel what no gate awaits any more; collect failures another gate already reported."""
        for task in self._responses.values():
            if not task.done():
                task.cancel()
        await asyncio.gather(*self._responses.values(), return_exceptions=True)
