"""Spares beyond Eq. 6 per model, for the :class:`~.controller.Controller`
(docs/policy.md, "Overshoot spares").

The rule is :mod:`warmserve.policy.overshoot` (pure); this mixin keeps its one piece of loop
memory — per model, the last window in which its demand passed its forecast peak — and asks for
a re-plan when a model is newly flagged (docs/policy.md "Overshoot spares")."""

from __future__ import annotations

from collections.abc import Iterable

from warmserve.policy.overshoot import near_batch_boundary, peak_exceeded, spares_for

from .config import ControlConfig
from .tracking import ModelState


class SpareTracking:
    """Per-model spare counts; :class:`~.controller.Controller` sets the fields in its
    constructor."""

    cfg: ControlConfig
    models: dict[str, ModelState]
    window_index: int | None
    replan_reasons: set[str]
    overshoot: dict[str, int]  # model -> the last window its demand passed its forecast peak

    def _note_overshoot(self) -> None:
        """Flag each model whose demand has passed its forecast peak in this window
        (:mod:`warmserve.policy.overshoot`); a newly flagged model's spare is planned now."""
        if not self.cfg.overshoot_spares or self.window_index is None:
            return
        w = self.window_index
        for model, st in self.models.items():
            if self.overshoot.get(model) == w:
                continue
            if peak_exceeded(st.tracker.peak_so_far, st.forecast):
                if self._spare_of(model) == self.cfg.spare_replicas:  # not held from the last
                    self.replan_reasons.add("peak forecast exceeded")
                self.overshoot[model] = w

    def spares(self) -> dict[str, int]:
        """Extra burst replicas per managed model beyond Eq. 6 now (``spare_replicas`` for
        every model, ``overshoot_spares`` more for a model whose forecast peak was exceeded
        this window or the last)."""
        return self._spares(self.models)

    def _spares(self, models: Iterable[str]) -> dict[str, int]:
        models = list(models)
        w = -1 if self.window_index is None else self.window_index
        return spares_for(
            {m: self.overshoot.get(m) for m in models}, w,
            base=self.cfg.spare_replicas, overshoot=self.cfg.overshoot_spares,
            near=self._near(models),
        )

    def _near(self, models: Iterable[str]) -> set[str]:
        h = self.cfg.overshoot_headroom
        if not h or not self.cfg.overshoot_spares:
            return set()
        return {
            m for m in models
            if near_batch_boundary(self.models[m].forecast, self.models[m].spec.max_batch, h)
        }

    def _spare_of(self, model: str) -> int:
        return self._spares((model,))[model]
