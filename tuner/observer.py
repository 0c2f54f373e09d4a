"""What a run reports as it goes. The base class reports nothing; the CLI draws it live."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from storage.records import TelemetrySample

if TYPE_CHECKING:
    from engine.hardware import Hardware
    from tuner.space import SearchSpace, TrialParams
    from tuner.study import Outcome


class RunObserver:
    def study_opened(self, name: str, hardware: "Hardware", space: "SearchSpace", *,
                     finished: int) -> None:
        pass

    def trial_started(self, number: int, params: "TrialParams") -> None:
        pass

    def sample(self, sample: TelemetrySample) -> None:
        """Called from the telemetry thread."""

    def trial_finished(self, outcome: "Outcome", best: Sequence[int]) -> None:
        pass

    def remeasuring(self, numbers: Sequence[int]) -> None:
        pass

    def warn(self, message: str) -> None:
        pass
