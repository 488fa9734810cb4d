"""Run outputs beyond the artifacts: metrics tables, test predictions, plots, report.md."""
