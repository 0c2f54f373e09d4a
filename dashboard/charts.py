"""Plotly figures of the pages; each takes a DataFrame from frames.py and returns a figure."""

from __future__ import annotations

from typing import Mapping

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
from plotly.subplots import make_subplots

# Telemetry series worth a timeline, with their axis titles.
TIMELINES = {
    "gpu_mem_mb": "GPU memory (MB)",
    "gpu_power_w": "GPU power (W)",
    "gpu_temp_c": "GPU temperature (C)",
    "gpu_sm_clock_mhz": "SM clock (MHz)",
    "gpu_util_pct": "GPU utilisation (%)",
    "cpu_pct": "CPU (%)",
    "rss_mb": "worker RSS (MB)",
    "ram_available_mb": "RAM available (MB)",
    "cgroup_mem_mb": "cgroup memory (MB)",
}
# NVML clocks-event reason bits; the tuner repeats a measurement on the throttling ones.
CLOCK_REASONS = {
    0x1: "GPU idle", 0x2: "application clocks", 0x4: "SW power cap", 0x8: "HW slowdown",
    0x10: "sync boost", 0x20: "SW thermal slowdown", 0x40: "HW thermal slowdown",
    0x80: "HW power brake", 0x100: "display clocks",
}
THROTTLING = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def pareto_figure(points: pd.DataFrame) -> go.Figure:
    """Decode tok/s against TTFT; colour is the draft, symbol PFlash, the front is joined."""
    points = points.assign(ttft_ms=points["ttft_s"] * 1e3)
    fig = px.scatter(points, x="ttft_ms", y="decode_tok_s", color="draft", symbol="pflash",
                     hover_data=["trial", "feasible", "pareto"],
                     labels={"ttft_ms": "time to first token (ms)", "decode_tok_s": "decode tok/s"})
    front = points[points["pareto"]].sort_values("ttft_ms")
    if not front.empty:
        fig.add_trace(go.Scatter(x=front["ttft_ms"], y=front["decode_tok_s"], mode="lines+markers",
                                 name="Pareto front", line={"dash": "dot", "color": "grey"},
                                 marker={"symbol": "circle-open", "size": 16, "color": "grey"},
                                 customdata=front["trial"],
                                 hovertemplate="trial %{customdata}<extra>Pareto front</extra>"))
    infeasible = points[~points["feasible"]]
    if not infeasible.empty:
        fig.add_trace(go.Scatter(x=infeasible["ttft_ms"], y=infeasible["decode_tok_s"],
                                 mode="markers", name="infeasible",
                                 marker={"symbol": "x-thin-open", "size": 14, "color": "red"},
                                 hoverinfo="skip"))
    fig.update_layout(margin={"t": 30}, legend_title_text="draft, PFlash")
    return fig


def heatmap_figure(df: pd.DataFrame, x: str, y: str, z: str, *, best: str) -> go.Figure:
    """The best ``z`` seen in each cell of the x-y grid (``best`` is "max" or "min"); cells
    no trial measured stay blank."""
    grid = pd.DataFrame({x: _cells(df[x]), y: _cells(df[y]), z: df[z]})
    table = grid.pivot_table(index=y, columns=x, values=z, aggfunc=best, observed=False)
    text = table.map(lambda v: "" if pd.isna(v) else f"{v:.4g}")
    fig = go.Figure(go.Heatmap(z=table.to_numpy(), x=[str(c) for c in table.columns],
                               y=[str(i) for i in table.index], text=text.to_numpy(),
                               texttemplate="%{text}", colorscale="Blues",
                               reversescale=best == "min", colorbar={"title": {"text": f"{best} {z}"}},
                               hovertemplate=f"{x} %{{x}}<br>{y} %{{y}}<br>{best} {z} %{{z:.4g}}<extra></extra>"))
    fig.update_layout(margin={"t": 30}, xaxis={"title": {"text": x}, "type": "category"},
                      yaxis={"title": {"text": y}, "type": "category"})
    return fig


def _cells(values: pd.Series, max_levels: int = 10) -> pd.Series:
    """Grid cells of one knob: its own values when few, else equal-width ranges."""
    levels = sorted(values.dropna().unique())
    names = [f"{v:.3g}" for v in levels]
    if len(levels) <= max_levels and len(set(names)) == len(names):
        return pd.Categorical(values.map(dict(zip(levels, names))), categories=names, ordered=True)
    edges = pd.cut(values, bins=max_levels // 2, retbins=True)[1]
    labels = [f"{lo:.3g}-{hi:.3g}" for lo, hi in zip(edges[:-1], edges[1:])]
    return pd.cut(values, bins=edges, labels=labels, include_lowest=True)


def scatter_figure(df: pd.DataFrame, x: str, z: str) -> go.Figure:
    fig = px.scatter(df, x=x, y=z, color="draft", hover_data=["trial"])
    fig.update_layout(margin={"t": 30})
    return fig


def parallel_figure(df: pd.DataFrame, dims: list[str], z: str) -> go.Figure:
    fig = px.parallel_coordinates(df, dimensions=[*dims, z], color=z,
                                  color_continuous_scale=px.colors.sequential.Viridis)
    fig.update_layout(margin={"t": 50, "l": 60, "r": 60})
    return fig


def importance_figure(importances: Mapping[str, float]) -> go.Figure:
    ranked = sorted(importances.items(), key=lambda kv: kv[1])
    fig = go.Figure(go.Bar(x=[v for _, v in ranked], y=[k for k, _ in ranked], orientation="h",
                           text=[f"{v:.2f}" for _, v in ranked], textposition="auto"))
    fig.update_layout(margin={"t": 30}, xaxis_title="importance (PED-ANOVA, normalised)",
                      height=120 + 40 * len(ranked))
    return fig


def timelines_figure(samples: pd.DataFrame) -> go.Figure | None:
    """One row per telemetry series that has readings, sharing the time axis."""
    present = [c for c in TIMELINES if c in samples and samples[c].notna().any()]
    if not present:
        return None
    fig = make_subplots(rows=len(present), cols=1, shared_xaxes=True, vertical_spacing=0.02)
    for row, column in enumerate(present, start=1):
        fig.add_trace(go.Scatter(x=samples["t_s"], y=samples[column], mode="lines+markers",
                                 name=TIMELINES[column], marker={"size": 4}), row=row, col=1)
        fig.update_yaxes(title_text=TIMELINES[column], row=row, col=1, title_font={"size": 10})
    fig.update_xaxes(title_text="seconds since the measurement started", row=len(present), col=1)
    fig.update_layout(height=150 * len(present) + 80, showlegend=False, margin={"t": 20})
    return fig


def reason_names(bits: int) -> list[str]:
    return [name for bit, name in CLOCK_REASONS.items() if bits & bit]


def throttle_figure(samples: pd.DataFrame) -> go.Figure | None:
    """Which clocks-event reasons were active when; None when the GPU reported none."""
    if "gpu_clock_reasons" not in samples or samples["gpu_clock_reasons"].notna().sum() == 0:
        return None
    known = samples.dropna(subset=["gpu_clock_reasons"])
    fig = go.Figure()
    for bit, name in CLOCK_REASONS.items():
        on = known[(known["gpu_clock_reasons"].astype("int64") & bit) != 0]
        if on.empty:
            continue
        fig.add_trace(go.Scatter(x=on["t_s"], y=[name] * len(on), mode="markers", name=name,
                                 marker={"color": "red" if bit & THROTTLING else "grey",
                                         "symbol": "square", "size": 9}))
    fig.update_layout(height=120 + 30 * max(1, len(fig.data)), margin={"t": 20}, showlegend=False,
                      xaxis_title="seconds since the measurement started",
                      xaxis_range=[float(samples["t_s"].min()), float(samples["t_s"].max())])
    return fig


def comparison_figure(df: pd.DataFrame) -> go.Figure:
    fig = px.bar(df, x="study", y="best decode tok/s", color="machine", barmode="group",
                 text_auto=".3g")
    fig.update_layout(margin={"t": 30}, legend={"orientation": "h", "y": -0.3})
    return fig
