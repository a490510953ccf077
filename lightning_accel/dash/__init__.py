"""accel-dash, the team's live view: every job that publishes a heartbeat (`GPUMonitor(publish=True)`, on by default
in accel-train) and this host's cards, on one read-only page; `cli.main` is the command, `state` what it shows,
`server` the web app, `static/` the page (uPlot, MIT, shipped here: the page loads nothing from elsewhere);
the usage kept: `usage_schema` (the observation and the tables), `usage_store` (this machine's writer), `usage_view`
(the page's data from several machines' databases, and `accel-dash usage --csv`)."""

from __future__ import annotations

__all__: list[str] = []
