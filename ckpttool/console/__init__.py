"""The process around the work: Ctrl-C while the command starts, the collector while a plan is built, and what
is shown on a terminal (escaped names, sizes, the progress bar, closed pipes)."""
