"""The dashboard's entry point: `streamlit run dashboard/app.py` (what `luce-tune dashboard` does).

Each page is a file beside this one, run by Streamlit's navigation at its own URL.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from dashboard import context

HERE = Path(__file__).resolve().parent
PAGES = (  # file, title, URL path
    ("overview.py", "Study overview", "overview"),
    ("trials.py", "Trials", "trials"),
    ("landscape.py", "Landscape", "landscape"),
    ("importance.py", "Parameter importance", "importance"),
    ("telemetry.py", "Telemetry", "telemetry"),
    ("profiles.py", "Published profile", "profile"),
    ("hardware.py", "Hardware comparison", "hardware"),
)


def main() -> None:
    st.set_page_config(page_title="luce-tune", layout="wide")
    page = st.navigation([st.Page(HERE / file, title=title, url_path=url, default=i == 0)
                          for i, (file, title, url) in enumerate(PAGES)])
    context.sidebar()
    page.run()


if __name__ == "__main__":
    main()
