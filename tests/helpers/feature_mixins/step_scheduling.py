"""Step-level scheduling (preemption, handoff, `--continuous-batching`): StepSchedulingTesterMixin.

The config's `step_scheduling_specs` are two requests: the first is exported at step boundaries, its state
sent as bytes and resumed by another denoiser; the second joins the first's continuous batch. A resumed run
must equal the uninterrupted one bit for bit; a run of a continuous batch equals its run alone within the
batching tolerance (rows at different timesteps share each transformer pass).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from stagekit.denoise_steps import state_from_bytes
from stagekit.errors import RequestError

_SCHEDULER_COPIES: dict[tuple[str, str], Path] = {}


def with_scheduler(
    model_dir: Path, name: str, config: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The checkpoint with its scheduler replaced by diffusers' `name` of `config` (the other parts linked)."""
    key = (str(model_dir), name)
    if key not in _SCHEDULER_COPIES:
        target = tmp_path_factory.mktemp("scheduler-copies") / f"{model_dir.name}-{name}"
        target.mkdir()
        for entry in model_dir.iterdir():
            if entry.name not in ("scheduler", "model_index.json"):
                (target / entry.name).symlink_to(entry.resolve())
        index = json.loads((model_dir / "model_index.json").read_text())
        index["scheduler"] = ["diffusers", name]
        (target / "model_index.json").write_text(json.dumps(index))
        (target / "scheduler").mkdir()
        (target / "scheduler" / "scheduler_config.json").write_text(json.dumps({"_class_name": name, **config}))
        _SCHEDULER_COPIES[key] = target
    return _SCHEDULER_COPIES[key]


class StepSchedulingTesterMixin:
    """A run exported at a step boundary, sent as bytes and continued by another denoiser ends bit for bit where
    the uninterrupted run ends, after one preemption or two, with each scheduler the family runs and on both sides
    of an expert switch; a state of another request, or a truncated one, is refused; runs of different seeds,
    guidance scales and step counts share a continuous batch, each joining and leaving at its own step."""

    def _finish(self: Any, denoiser: Any, run: Any) -> torch.Tensor:
        while not run.done:
            denoiser.step([run])
        return denoiser.result(run)

    def _handoff(self: Any, data: bytes, denoiser: Any, spec: Any, conditioning: dict[str, torch.Tensor]) -> Any:
        """The run `denoiser` continues from a state's bytes, read as the DiT stage reads them."""
        fresh = denoiser.begin(spec, conditioning)
        state = state_from_bytes(data, tuple(fresh.latents.shape), fresh.digest)
        return denoiser.begin(spec, conditioning, state)

    def _round_trips(self: Any, model_dir: Path) -> None:
        first = self.build_denoiser(model_dir, torch.float32)
        second = self.build_denoiser(model_dir, torch.float32)
        spec = self.step_scheduling_specs[0]
        conditioning = self.conditioning(first, spec)
        want = self.denoised(first, spec, conditioning)
        total = spec.num_inference_steps
        assert total >= 3, "at least two step boundaries"
        for k in range(1, total):
            run = first.begin(spec, conditioning)
            for _ in range(k):
                first.step([run])
            assert run.exportable
            resumed = self._handoff(run.export().to_bytes(), second, spec, conditioning)
            assert resumed.step_index == k and not resumed.done
            got = self._finish(second, resumed)
            print(
                f"{type(run.scheduler).__name__}: state at step {k} of {total}, max abs diff "
                f"{(got - want).abs().max().item():.2e}"
            )
            assert torch.equal(got, want), f"resumed at step {k} of {total}"

    def test_a_state_at_each_step_boundary_resumes_exactly_on_another_denoiser(self: Any, model_dir: Path) -> None:
        self._round_trips(model_dir)

    def test_two_preemptions_in_a_row_resume_exactly(self: Any, model_dir: Path) -> None:
        first = self.build_denoiser(model_dir, torch.float32)
        second = self.build_denoiser(model_dir, torch.float32)
        spec = self.step_scheduling_specs[0]
        conditioning = self.conditioning(first, spec)
        want = self.denoised(first, spec, conditioning)
        run = first.begin(spec, conditioning)
        first.step([run])
        run = self._handoff(run.export().to_bytes(), second, spec, conditioning)
        while run.step_index < spec.num_inference_steps - 1:
            second.step([run])
        run = self._handoff(run.export().to_bytes(), first, spec, conditioning)
        assert torch.equal(self._finish(first, run), want)

    def test_a_state_of_another_request_or_truncated_is_refused(self: Any, model_dir: Path) -> None:
        import dataclasses

        denoiser = self.build_denoiser(model_dir, torch.float32)
        spec = self.step_scheduling_specs[0]
        conditioning = self.conditioning(denoiser, spec)
        run = denoiser.begin(spec, conditioning)
        denoiser.step([run])
        data = run.export().to_bytes()
        shape = tuple(run.latents.shape)
        other_seed = dataclasses.replace(spec, seed=spec.seed + 1)
        other_prompt = dict(conditioning, prompt_embeds=conditioning["prompt_embeds"].flip(1))
        for other_spec, other_conditioning in ((other_seed, conditioning), (spec, other_prompt)):
            other = denoiser.begin(other_spec, other_conditioning)
            assert other.digest != run.digest
            with pytest.raises(RequestError, match="denoise_state"):
                state_from_bytes(data, shape, other.digest)
        for cut in (len(data) // 2, len(data) - 1, 16):
            with pytest.raises(RequestError, match="denoise_state"):
                state_from_bytes(data[:cut], shape, run.digest)
        assert state_from_bytes(data, shape, run.digest).step == 1

    def test_runs_of_different_step_counts_share_a_continuous_batch(self: Any, model_dir: Path) -> None:
        denoiser = self.build_denoiser(model_dir, torch.float32)
        specs = self.step_scheduling_specs
        a_spec, b_spec = specs
        assert a_spec.seed != b_spec.seed and a_spec.guidance_scale != b_spec.guidance_scale
        assert a_spec.num_inference_steps > b_spec.num_inference_steps + 1, "B joins after A's first step, leaves first"
        conditionings = [self.conditioning(denoiser, spec) for spec in specs]
        alone = [self.denoised(denoiser, spec, c) for spec, c in zip(specs, conditionings, strict=True)]
        a = denoiser.begin(a_spec, conditionings[0])
        denoiser.step([a])
        b = denoiser.begin(b_spec, conditionings[1])
        assert a.timesteps[a.step_index] != b.timesteps[b.step_index], "the rows at different timesteps"
        shared = 0
        while not a.done and not b.done:
            denoiser.step([a, b])
            shared += 1
        assert b.done and not a.done and shared == b_spec.num_inference_steps
        got = [self._finish(denoiser, b), self._finish(denoiser, a)][::-1]
        for name, result, want in zip("AB", got, alone, strict=True):
            difference = (result - want).abs().max().item()
            print(f"run {name}: max abs diff {difference:.2e} from its run alone (exact: {torch.equal(result, want)})")
            assert difference <= self.continuous_batch_tolerance, f"run {name}: max abs difference {difference:.2e}"


class StepSchedulingSchedulersTesterMixin(StepSchedulingTesterMixin):
    """The round trips again with each further scheduler the family runs (`step_scheduling_schedulers`), each on
    a copy of the checkpoint with that scheduler: flow-matching Euler for Wan beside its UniPC."""

    def test_a_state_resumes_exactly_with_each_further_scheduler(
        self: Any, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        assert self.step_scheduling_schedulers, "a config that mixes this in names further schedulers"
        for name, config in self.step_scheduling_schedulers.items():
            copy = with_scheduler(model_dir, name, config, tmp_path_factory)
            denoiser = self.build_denoiser(copy, torch.float32)
            spec = self.step_scheduling_specs[0]
            run = denoiser.begin(spec, self.conditioning(denoiser, spec))
            assert type(run.scheduler).__name__ == name
            self._round_trips(copy)


class StepSchedulingExpertsTesterMixin(StepSchedulingTesterMixin):
    """For a family with two experts (Wan2.2 A14B): states taken before, at and after the expert switch resume
    exactly, and one step of a batch whose rows sit on different experts runs each expert once per branch."""

    def test_states_around_the_expert_switch_and_a_batch_across_experts(self: Any, model_dir: Path) -> None:
        assert len(self.expert_names) == 2, "a config that mixes this in has two experts"
        denoiser = self.build_denoiser(model_dir, torch.float32)
        a_spec, b_spec = self.step_scheduling_specs
        run = denoiser.begin(a_spec, self.conditioning(denoiser, a_spec))
        experts = [id(denoiser.expert_for(t, run.boundary_timestep)) for t in run.timesteps]
        switch = next(index for index in range(len(experts)) if experts[index] != experts[0])
        # The round trips take a state at every boundary: before the switch, at it and after it.
        assert 1 < switch < len(experts) - 1, f"the expert switches at step {switch} of {len(experts)}"
        conditionings = [self.conditioning(denoiser, spec) for spec in (a_spec, b_spec)]
        alone = [self.denoised(denoiser, spec, c) for spec, c in zip((a_spec, b_spec), conditionings, strict=True)]
        a = denoiser.begin(a_spec, conditionings[0])
        while a.step_index < switch:
            denoiser.step([a])
        b = denoiser.begin(b_spec, conditionings[1])
        calls = [0] * len(denoiser.experts)
        handles = [
            expert.register_forward_pre_hook(lambda module, args, i=i: calls.__setitem__(i, calls[i] + 1))
            for i, expert in enumerate(denoiser.experts)
        ]
        try:
            denoiser.step([a, b])  # A on the second expert, B on the first
        finally:
            for handle in handles:
                handle.remove()
        assert calls == [2, 2], f"forwards per expert in a step across experts: {calls}"
        while not a.done and not b.done:
            denoiser.step([a, b])
        got = [self._finish(denoiser, a), self._finish(denoiser, b)]
        for name, result, want in zip("AB", got, alone, strict=True):
            difference = (result - want).abs().max().item()
            print(f"run {name} across experts: max abs diff {difference:.2e} (exact: {torch.equal(result, want)})")
            assert difference <= self.continuous_batch_tolerance, f"run {name}: max abs difference {difference:.2e}"
