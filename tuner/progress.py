"""The live view of `luce-tune run` (rich): the trial in flight, telemetry, best so far."""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from storage.records import TelemetrySample
from tuner.observer import RunObserver

RECENT = 8


class LiveProgress(RunObserver):
    def __init__(self, console: Console, objectives: Sequence[str]) -> None:
        self.console = console
        self.objectives = tuple(objectives)
        self._lock = threading.Lock()
        self._header = Text("opening the study...")
        self._current: tuple[int, str, float] | None = None
        self._sample: TelemetrySample | None = None
        self._done: list[Any] = []
        self._best: list[int] = []
        self._live = Live(get_renderable=self._render, console=console, refresh_per_second=4,
                          transient=True)

    def __enter__(self) -> "LiveProgress":
        self._live.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._live.stop()

    def study_opened(self, name, hardware, space, *, finished) -> None:
        gpu = f"{hardware.gpu.name} ({hardware.gpu.total_mb} MB)" if hardware.gpu else "no GPU"
        dims = ", ".join(name for name, on in (("expert budget", space.budget_max_mb),
                                               ("draft + spec_len", space.drafts),
                                               ("lookup", space.spec_lookup is not None),
                                               ("pflash", space.keep_ratio is not None)) if on)
        with self._lock:
            self._header = Text.assemble(
                ("study ", "dim"), (name, "bold"), ("  |  ", "dim"), gpu, ("  |  ", "dim"),
                f"{hardware.cpu_count} CPUs, {hardware.ram_mb} MB RAM", ("  |  search: ", "dim"),
                dims or "nothing to choose", ("  |  ", "dim"), f"{finished} trials already finished")

    def trial_started(self, number, params) -> None:
        with self._lock:
            self._current = (number, params.label(), time.monotonic())
            self._sample = None

    def sample(self, sample: TelemetrySample) -> None:
        with self._lock:
            self._sample = sample

    def trial_finished(self, outcome, best) -> None:
        with self._lock:
            self._done.append(outcome)
            self._best = list(best)
            self._current = None

    def remeasuring(self, numbers) -> None:
        with self._lock:
            self._current = (-1, "re-measuring finalists " + ", ".join(f"#{n}" for n in numbers),
                             time.monotonic())

    def warn(self, message: str) -> None:
        self._live.console.print(f"[yellow]warning:[/yellow] {escape(message)}", highlight=False)

    def _render(self) -> Group:
        with self._lock:
            parts: list[Any] = [self._header]
            if self._current is not None:
                number, label, t0 = self._current
                title = f"trial #{number}" if number >= 0 else "publishing"
                parts.append(Text.assemble((f"{title}: ", "bold cyan"), label,
                                           (f"  {time.monotonic() - t0:.0f} s", "dim")))
                if self._sample is not None:
                    parts.append(Text(telemetry_line(self._sample), style="dim"))
            if self._done:
                parts.append(outcome_table(self._done[-RECENT:], self.objectives, self._best))
            return Group(*parts)


def telemetry_line(s: TelemetrySample) -> str:
    line = f"cpu {s.cpu_pct:.0f}%  rss {s.rss_mb:.0f} MB  free RAM {s.ram_available_mb:.0f} MB"
    if s.gpu_mem_mb is not None:
        line += f"  |  gpu {s.gpu_mem_mb:.0f} MB"
        for value, fmt in ((s.gpu_util_pct, " {:.0f}%"), (s.gpu_power_w, "  {:.0f} W"),
                           (s.gpu_temp_c, "  {:.0f} C"), (s.gpu_sm_clock_mhz, "  {:.0f} MHz")):
            if value is not None:
                line += fmt.format(value)
    return line


def outcome_table(outcomes: Sequence[Any], objectives: Sequence[str], best: Sequence[int]) -> Table:
    table = Table(show_edge=False, pad_edge=False, expand=False)
    table.add_column("#", justify="right")
    table.add_column("parameters")
    for name in objectives:
        table.add_column(name, justify="right")
    table.add_column("status")
    for o in outcomes:
        values = [f"{v:.4g}" for v in o.values] if o.values else ["-"] * len(objectives)
        status = o.status + (f": {o.reason}" if o.reason else "")
        mark = " *" if o.number in best else ""
        style = "green" if o.number in best else ("red" if o.status == "failed" else None)
        table.add_row(f"{o.number}{mark}", Text(o.params.label()), *values, Text(status), style=style)
    return table
