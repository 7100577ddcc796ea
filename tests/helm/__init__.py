"""helm, built from its Go module (build.py), and the chart as the tests drive it (chart.py)."""
