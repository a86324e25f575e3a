"""The TVM adapter: every TVM call the kernels, models and build make that tends to change
between releases (targets, passes, graph, export, schedules, tvmscript)."""
