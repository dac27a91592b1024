"""The evaluation harness: the side-by-side benchmark and its plots, the draft's fidelity measures,
the prompt sets, and batch files (input lines, the append-only results file)."""
