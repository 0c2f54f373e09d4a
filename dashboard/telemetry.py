"""Per-trial telemetry: VRAM, power, temperature, clocks, CPU, memory and throttle flags."""

from __future__ import annotations

import streamlit as st

from dashboard import charts, context, frames


def render() -> None:
    st.title("Telemetry")
    view = context.study()
    src = context.source()
    if not view.measurements:
        st.info(f"Study {view.study.name!r} has no measurement yet.")
        return
    numbers = sorted({m.trial_number for m in view.measurements})
    wanted = st.query_params.get("trial")
    default = int(wanted) if wanted and wanted.isdigit() and int(wanted) in numbers else numbers[-1]
    left, right = st.columns(2)
    number = left.selectbox("Trial", numbers, index=numbers.index(default), key="telemetry_trial")
    own = [m for m in view.measurements if m.trial_number == number]
    labels = [f"{m.phase} attempt {m.attempt}: {m.status}" for m in own]
    picked = right.selectbox("Measurement", range(len(own)), format_func=labels.__getitem__,
                             key="telemetry_measurement")
    m = own[picked]
    cols = st.columns(4)
    cols[0].metric("Decode tok/s", context.tok_s(m.decode_tok_s))
    cols[1].metric("TTFT", context.ms(m.ttft_s))
    cols[2].metric("Peak memory", "\u2014" if m.peak_mem_mb is None else f"{m.peak_mem_mb:,.0f} MB")
    cols[3].metric("Throttled", "yes" if m.throttled else "no")
    if m.reason:
        st.warning(f"{m.status}: {m.reason}")
    samples = frames.samples_frame(src.samples(m.id))
    if samples.empty:
        st.info("No telemetry samples were recorded for this measurement.")
        return
    st.caption(f"{len(samples)} samples over {samples['t_s'].max():.1f} s.")
    if samples["gpu_mem_mb"].isna().all():
        st.caption("No GPU readings: this measurement ran without NVML (CPU only).")
    st.plotly_chart(charts.timelines_figure(samples), key="telemetry_timelines")
    flags = charts.throttle_figure(samples)
    if flags is None:
        st.caption("No clocks-event reasons were reported.")
    else:
        st.markdown("**Clocks-event reasons** (red: throttling)")
        st.plotly_chart(flags, key="telemetry_throttle")
    with st.expander("Summary the tuner stored"):
        st.json(dict(m.telemetry))


if __name__ == "__main__":
    render()
